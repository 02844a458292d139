"""`nodectl collect`: logs, heartbeats, metrics and outputs of a run into runs/<run_id>/nodes/<node>/."""
from __future__ import annotations

import tarfile
import tempfile
from pathlib import Path

import click
from rich.markup import escape

from nodectl.remote import agent
from nodectl.cli.context import AppContext
from nodectl.cli.runs_cmds import opened, run_option
from nodectl.errors import exit_code_for


def collect_node(transport, run_dir: str, target: Path) -> dict:
    packed = agent.call(transport, "pack", run_dir, timeout=600)
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / "collect.tar.gz"
        transport.get(packed.archive, local)
        agent.call(transport, "cleanup", packed.archive)
        target.mkdir(parents=True, exist_ok=True)
        with tarfile.open(local) as tar:
            tar.extractall(target, filter="data")
    return {"bytes": packed.bytes, "entries": packed.entries}


@click.command("collect")
@run_option
@click.pass_obj
def command(app: AppContext, run_id: str | None) -> None:
    """Bring a run's logs, heartbeats, metrics and outputs (not the code) back here."""
    run = opened(app, run_id)
    run_nodes = {rn.node.name: rn for rn in run.nodes()}
    with app.cluster_for(run_nodes.values()) as cluster, \
            app.node_progress("collecting", len(run_nodes)) as advance:
        results = cluster.fan_out(
            lambda t: collect_node(t, run_nodes[t.node.name].run_dir, run.folder / "nodes" / t.node.name),
            on_done=advance)
    for result in results:
        if result.ok:
            app.info(f"{result.node.name}: {result.value['bytes'] / 1024:.0f} KiB -> "
                     f"{run.folder / 'nodes' / result.node.name}/")
        else:
            app.err.print(f"[red]{escape(result.node.name)}[/]: {escape(result.error)}")
    if app.json:
        app.emit_json({"run_id": run.run_id, "folder": str(run.folder / "nodes"),
                       "nodes": {r.node.name: r.value if r.ok else {"error": r.error} for r in results}})
    if exit_code_for(results):
        raise SystemExit(exit_code_for(results))
