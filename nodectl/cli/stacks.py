"""`nodectl stacks`: the Python stack of every rank, saved under runs/<run_id>/stacks/ and printed."""
from __future__ import annotations

import click
from rich.markup import escape

from nodectl.cli.context import AppContext
from nodectl.cli.run_option import opened, run_option
from nodectl.errors import EXIT_FAILED, exit_code_for
from nodectl.remote.client import NodeClient


@click.command("stacks")
@run_option
@click.pass_obj
def command(app: AppContext, run_id: str | None) -> None:
    """Gather every rank's Python stack (py-spy, or SIGUSR1 for programs that registered faulthandler)."""
    run = opened(app, run_id)
    run_nodes = {rn.node.name: rn for rn in run.nodes()}
    folder = run.folder / "stacks"
    folder.mkdir(exist_ok=True)
    with app.cluster_for(run_nodes.values()) as cluster, \
            app.node_progress("gathering stacks", len(run_nodes)) as advance:
        results = cluster.fan_out(lambda t: NodeClient(t).stacks(run_nodes[t.node.name].run_dir),
                                  on_done=advance)
    gathered = {}
    for result in results:
        if not result.ok:
            app.err.print(f"[red]{escape(result.node.name)}[/]: {escape(result.said.partition(': ')[2])}")
            continue
        if not result.value.stacks:
            app.err.print(f"[red]{escape(result.node.name)}[/]: no rank of run {escape(run.run_id)} there to take "
                          f"a stack of (not started, or its folder is gone)")
        for rank, entry in result.value.stacks.items():
            text = entry.text or f"(no stack: {entry.error})\n"
            (folder / f"rank{rank}.txt").write_text(text)
            gathered[int(rank)] = {"node": result.node.name, "text": entry.text, "error": entry.error}
    if app.json:
        app.emit_json({"run_id": run.run_id, "stacks": gathered})
    else:
        for rank in sorted(gathered):
            app.heading(f"rank {rank} on {escape(gathered[rank]['node'])}")
            app.out.print(gathered[rank].get("text") or f"no stack: {gathered[rank].get('error')}",
                          markup=False, highlight=False)
        if gathered:
            app.info(f"saved under {folder}/")
    code = exit_code_for(results) or (EXIT_FAILED if not gathered else 0)
    if code:
        raise SystemExit(code)
