"""`nodectl runs`: the recorded runs, newest last, found in ./runs and in the registry from any folder.

A run recorded as starting or running is asked of its nodes (briefly) so the state shown is the real one.
"""
from __future__ import annotations

import time

import click
from rich.table import Table

from nodectl.cli.context import AppContext
from nodectl.cli.runs_cmds import refresh_state
from nodectl.errors import UsageError
from nodectl.runs import Manifest, Run, list_runs
from nodectl.remote.transport import Cluster, TransportOptions
from nodectl.watch import poll


def _settle(app: AppContext, runs: list[Run]) -> None:
    options = TransportOptions(connect_timeout=min(app.transport_options.connect_timeout, 5.0),
                               fanout=app.transport_options.fanout,
                               accept_new_host_keys=app.transport_options.accept_new_host_keys)
    for run in runs:
        manifest = _readable(run)
        if manifest is None or manifest.state.final:
            continue
        run_nodes = run.nodes()
        with Cluster([rn.node for rn in run_nodes], options) as cluster:
            refresh_state(run, poll(cluster, run_nodes))


def _readable(run: Run) -> Manifest | None:
    try:
        return run.read()
    except UsageError:
        return None


@click.command("runs")
@click.option("--all", "show_all", is_flag=True, help="Also preflight's own collective-test jobs.")
@click.pass_obj
def command(app: AppContext, show_all: bool) -> None:
    """List runs with their state, nodes and start time."""
    runs = list_runs(include_preflight=show_all)
    _settle(app, runs)
    rows = []
    for run in runs:
        manifest = _readable(run)
        if manifest is None:   # one damaged record is a row saying so, never the end of the listing
            rows.append({"run_id": run.run_id, "kind": "?", "state": "unreadable", "nodes": [], "world_size": 0,
                         "started": None, "folder": str(run.folder.resolve()),
                         "command": f"manifest.json cannot be read: {run.manifest_path}"})
            continue
        plan = manifest.plan
        rows.append({"run_id": run.run_id, "kind": manifest.kind, "state": manifest.state.value,
                     "nodes": manifest.node_names, "world_size": sum(n["nproc"] for n in plan.get("nodes", [])),
                     "started": manifest.started, "folder": str(run.folder.resolve()),
                     "command": " ".join(plan.get("command", []))})
    if app.json:
        app.emit_json({"runs": rows})
        return
    table = Table(title_justify="left")
    for column in ("run", "state", "nodes", "world", "started", "command"):
        table.add_column(column, overflow="fold")
    for row in rows:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row["started"])) if row["started"] else "-"
        label = row["run_id"] + (" (preflight)" if row["kind"] == "preflight" else "")
        table.add_row(label, row["state"] or "-", ",".join(row["nodes"]), str(row["world_size"]), started,
                      row["command"])
    app.out.print(table if rows else "no runs yet")
