"""`nodectl runs`: the recorded runs, newest last."""
from __future__ import annotations

import time

import click
from rich.table import Table

from nodectl.cli.context import AppContext
from nodectl.runs import list_runs


@click.command("runs")
@click.pass_obj
def command(app: AppContext) -> None:
    """List runs with their state, nodes and start time."""
    rows = []
    for run in list_runs():
        manifest = run.manifest()
        plan = manifest.get("plan", {})
        rows.append({"run_id": run.run_id, "state": manifest.get("state"),
                     "nodes": [n["node"]["name"] for n in plan.get("nodes", [])],
                     "world_size": sum(n["nproc"] for n in plan.get("nodes", [])),
                     "started": manifest.get("started"), "command": " ".join(plan.get("command", []))})
    if app.json:
        app.emit_json({"runs": rows})
        return
    table = Table(title_justify="left")
    for column in ("run", "state", "nodes", "world", "started", "command"):
        table.add_column(column, overflow="fold")
    for row in rows:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row["started"])) if row["started"] else "-"
        table.add_row(row["run_id"], row["state"] or "-", ",".join(row["nodes"]), str(row["world_size"]), started,
                      row["command"])
    app.out.print(table if rows else "no runs yet")
