"""`nodectl runs`: the recorded runs, newest last, found in ./runs and in the registry from any folder.

A run recorded as starting or running is asked of its nodes (briefly) so the state shown is the real one.
"""
from __future__ import annotations

import re
import time

import click
from rich.markup import escape

from nodectl import goodput
from nodectl.pace import pace_lines
from nodectl.cli.context import AppContext
from nodectl.cli.run_option import refresh_state, warn_untrusted
from nodectl.errors import UsageError
from nodectl.hostlist import fold
from nodectl.runs import Manifest, Run, RunState, list_runs
from nodectl.cli.tables import Column, make_table
from nodectl.transport import Cluster, TransportOptions
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
    warn_untrusted(app)
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
                     "nodes": manifest.node_names, "world_size": plan.world_size,
                     "ranks_per_node": [np.nproc for np in plan.nodes],
                     "started": manifest.started, "folder": str(run.folder.resolve()),
                     "command": " ".join(plan.command),
                     "cause": manifest.cause if manifest.state != RunState.SUCCEEDED else None,
                     "outputs": manifest.outputs_url,
                     "pace": [line for line in pace_lines(manifest.pace, live=manifest.state == RunState.RUNNING)
                              if not line.startswith("pace ")],
                     "goodput": _goodput(run)})
    if app.json:
        app.emit_json({"runs": rows})
        return
    if not rows:
        app.out.print("no runs yet")
        return
    app.out.print(render(rows))
    for line in notes(rows):   # at full width: a URL to copy, a cause to read, never folded into a column
        app.out.print(line, soft_wrap=True)


COLUMNS = (Column("run", key=True), Column("state", whole=True), Column("started", whole=True),
           Column("goodput", "right", whole=True), Column("nodes, ranks: command"))


def _goodput(run: Run) -> dict | None:
    """The run's goodput ledger (nodectl/goodput.py) as JSON; None for a run recorded before the ledger."""
    try:
        spent = goodput.of_run(run)
    except (OSError, ValueError):
        return None
    return spent.to_json() if spent else None


def render(rows: list[dict]):
    """One row per run; the run id (what users copy) is never split."""
    cells = []
    for row in rows:
        started = time.strftime("%m-%d %H:%M", time.localtime(row["started"])) if row["started"] else "-"
        label = escape(row["run_id"])
        what = escape(f"{_placement(row)}: " + ("(preflight) " if row["kind"] == "preflight" else "")
                      + row["command"])
        share = (row.get("goodput") or {}).get("goodput")
        cells.append([label, escape(row["state"] or "-"), started, f"{share * 100:.0f}%" if share is not None else "-",
                      what])
    return make_table(COLUMNS, cells, keep=("run", "state"))


def _placement(row: dict) -> str:
    """`node[0-1], 2 ranks each` (or each node's count where they differ): never `x 4`, which read as either."""
    nodes = re.sub(r",(?![^\[]*\])", ", ", fold(row["nodes"]))
    per = row.get("ranks_per_node") or []
    if per and len(set(per)) == 1:
        return f"{nodes}, {per[0]} rank{'s' if per[0] != 1 else ''} each"
    if per:
        return f"{nodes}, {'+'.join(str(p) for p in per)} ranks"
    return f"{nodes}, {row['world_size']} ranks"


def notes(rows: list[dict]) -> list[str]:
    """Under the table, a line per run that has them: where its outputs are uploaded, and why it did not succeed."""
    out = []
    for row in rows:
        if row.get("outputs"):
            out.append(f"{escape(row['run_id'])} outputs: {escape(row['outputs'])}")
        if row.get("cause"):
            out.append(f"{escape(row['run_id'])} [red]{escape(row['cause'])}[/]")
        for line in row.get("pace") or ():
            out.append(f"{escape(row['run_id'])} [yellow]{escape(line)}[/]")
        spent = row.get("goodput") or {}
        lost = sorted(((k, v) for k, v in (spent.get("lost_s") or {}).items() if v >= 0.5), key=lambda kv: -kv[1])
        if lost and spent.get("goodput") is not None:
            out.append(f"{escape(row['run_id'])} lost " + ", ".join(f"{escape(k)} {goodput.span(v)}" for k, v in lost))
    return out
