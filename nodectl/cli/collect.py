"""`nodectl collect`: logs, heartbeats, metrics and outputs of a run into runs/<run_id>/nodes/<node>/."""
from __future__ import annotations

from dataclasses import asdict

import click
from rich.markup import escape

from nodectl.cli.context import AppContext
from nodectl.cli.run_option import opened, run_option
from nodectl.errors import EXIT_FAILED, InventoryError, UsageError, exit_code_for
from nodectl.outputs import download_run
from nodectl.remote.collect import collect_node
from nodectl.terminal_text import sized, visible


@click.command("collect")
@run_option
@click.option("--path", "paths", multiple=True, metavar="PATH",
              help="Also bring back this path of the node's run folder (repeatable), e.g. a synced file under "
                   "code/ (what the program itself wrote under code/ comes back without it).")
@click.option("--from-store", "from_store", is_flag=True,
              help="Take the run's outputs, logs and metrics from its bucket (outputs:) instead of the nodes: for a "
                   "run whose nodes are gone.")
@click.argument("positional", metavar="[RUN]", required=False)
@click.pass_obj
def command(app: AppContext, run_id: str | None, paths: tuple[str, ...], from_store: bool,
            positional: str | None) -> None:
    """Bring a run's logs, heartbeats, metrics and outputs back here: the run folder, and what the program wrote
    under code/ (not the synced project itself). RUN may be given as --run RUN or on its own."""
    if run_id and positional and run_id != positional:
        raise UsageError(f"two runs named: --run {run_id} and {positional}; give one")
    run_id = run_id or positional
    if from_store:
        if paths:
            raise UsageError("--path names a file on the nodes; --from-store takes what the bucket holds")
        _from_store(app, opened(app, run_id))
        return
    for path in paths:
        parts = path.split("/")
        if not path or path.startswith(("/", "~")) or ".." in parts:
            raise UsageError(f"--path {path!r}: name a path inside the run folder, relative to it (code/out)")
    run = opened(app, run_id)
    current = {rn.node.name for rn in run.nodes()}
    run_nodes: dict = {}
    for rn in run.nodes(left_out=True):   # a node a restart left out holds the attempts it ran: its logs too
        run_nodes.setdefault(rn.node.name, rn)
    left = set(run_nodes) - current
    with app.cluster_for(run_nodes.values()) as cluster, \
            app.node_progress("collecting", len(run_nodes)) as advance:
        results = cluster.fan_out(
            lambda t: collect_node(t, run_nodes[t.node.name].run_dir, run.folder / "nodes" / t.node.name, paths),
            on_done=advance)
    for result in results:
        if result.ok:
            collected = result.value
            app.info(f"{result.node.name}: {collected.bytes / 1024:.0f} KiB -> "
                     f"{run.folder / 'nodes' / result.node.name}/")
            if collected.code_written:
                app.info(f"  code/: {collected.code_written} file(s) the program wrote there, brought back ("
                         f"{', '.join(collected.code_examples[:3])}{', ...' if collected.code_written > 3 else ''}); "
                         f"the {collected.code_left} synced project file(s) left on the node")
            for what, names in (("asked for with --path and not found", collected.missing),
                                ("refused (not a plain file or folder inside the run)", collected.refused),
                                ("left out on the node (fifo, socket, device or a link out of the run)",
                                 collected.skipped)):
                if names:
                    app.err.print(f"[yellow]{escape(result.node.name)}[/]: {len(names)} entr"
                                  f"{'y' if len(names) == 1 else 'ies'} {what}: "
                                  + ", ".join(escape(visible(n, colour=False)) for n in names[:5]))
        elif result.node.name in left:
            app.err.print(f"[yellow]{escape(result.node.name)}[/] (left out of the run by a restart): its files "
                          f"could not be brought ({escape(result.said.partition(': ')[2])}); "
                          f"{escape(_later(run, result.node.name))}")
        else:
            app.err.print(f"[red]{escape(result.node.name)}[/]: {escape(result.said.partition(': ')[2])}")
    if app.json:
        app.emit_json({"run_id": run.run_id, "folder": str(run.folder / "nodes"),
                       "nodes": {r.node.name: asdict(r.value) if r.ok else {"error": r.error} for r in results},
                       "left_out": {r.node.name: None if r.ok else {"error": r.error, "later": _later(run, r.node.name)}
                                    for r in results if r.node.name in left}})
    # a left-out node out of reach is said, not failed: it was left out because it failed
    code = exit_code_for([r for r in results if r.node.name not in left])
    if code:
        raise SystemExit(code)


def _later(run, node: str) -> str:
    """How to get a left-out node's files once it answers again (or from the bucket its uploader sent to)."""
    said = f"when {node} answers again: nodectl collect --run {run.run_id}"
    if run.read().plan.outputs is not None:
        said += f"; what its uploader sent is in the bucket: nodectl collect --run {run.run_id} --from-store"
    return said


def _from_store(app: AppContext, run) -> None:
    """What each node of the run last uploaded (its index), into runs/<run_id>/nodes/<node>/."""
    manifest = run.read()
    stores = manifest.node_outputs
    if not stores:
        raise UsageError(f"run {run.run_id} has no outputs: (no bucket was given at its launch); nodectl collect "
                         f"brings its files from the nodes")
    try:   # the inventory's credentials for the store, where it holds them; else this machine's own
        env = app.inventory().nodes[0].env
    except (InventoryError, UsageError):
        env = {}
    fetched = []
    for name, outputs in stores.items():
        fetched += download_run(outputs, run.run_id, [name], run.folder / "nodes", env)
    for item in fetched:
        app.info(f"{item.node}: {item.files} file(s), {sized(item.bytes)} from "
                 f"{stores[item.node].run_url(run.run_id)}{item.node}/ -> {item.folder}/")
        for failed in item.failed[:5]:   # one refused entry each; the node's other files came home
            app.err.print(f"[yellow]{escape(item.node)}[/]: not brought: {escape(str(failed.get('path')))} "
                          f"({escape(str(failed.get('error')))})")
        if item.failed_count > 5:
            app.err.print(f"[yellow]{escape(item.node)}[/]: and {item.failed_count - 5} more not brought")
    if app.json:
        app.emit_json({"run_id": run.run_id, "folder": str(run.folder / "nodes"),
                       "stores": {name: o.run_url(run.run_id) for name, o in stores.items()},
                       "nodes": {item.node: {"files": item.files, "bytes": item.bytes,
                                             "not_brought": item.failed_count} for item in fetched}})
    if any(item.failed_count for item in fetched):
        raise SystemExit(EXIT_FAILED)
