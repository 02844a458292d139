"""`nodectl env-dump`: one JSON snapshot per node, a table of key facts, or only what differs."""
from __future__ import annotations

import errno
import json
from pathlib import Path

import click
from rich.markup import escape

from nodectl.cli.context import AppContext
from nodectl import environment as environments
from nodectl.cli.options import node_selection
from nodectl.envdump import diff_reports, summary_row
from nodectl.errors import EXIT_FAILED, EXIT_UNREACHABLE, NodectlError, UsageError
from nodectl.remote.envs import use_built
from nodectl.remote.probe_nodes import probe_nodes
from nodectl.cli.tables import Column, make_table


@click.command("env-dump")
@node_selection
@click.option("--diff", is_flag=True, help="Only the keys whose values differ between nodes.")
@click.option("-o", "--output", type=click.Path(file_okay=False, path_type=Path),
              help="Write one <node>.json per node into this folder.")
@click.pass_obj
def command(app: AppContext, nodes: int | None, exclude: tuple[str, ...], diff: bool, output: Path | None) -> None:
    """Snapshot every node (OS, CPU, memory, Python packages, torch/CUDA/NCCL, GPUs, NICs, IB, limits, env)."""
    if output and output.exists() and not output.is_dir():
        raise UsageError(f"-o {output}: not a folder (give a folder to write one <node>.json per node into)")
    inventory = app.inventory().select(nodes, exclude)
    inventory = environments.bind_locks(inventory, ".")   # environment: files are read from the project here
    with app.cluster(inventory) as cluster, app.node_progress("probing nodes", len(inventory.nodes)) as advance:
        inventory = use_built(cluster, inventory)
        results = probe_nodes(cluster, on_done=advance)
    reports = {name: report for name, report in results.succeeded.items() if "error" not in report}
    failed = {r.node.name: r.error or r.value.get("error") for r in results if r.node.name not in reports}
    unreachable = {r.node.name: r.error for r in results if r.unreachable}
    if output:
        try:
            output.mkdir(parents=True, exist_ok=True)
            for name, report in reports.items():
                (output / f"{name}.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise   # "the local disk is full", said by the command line for every command
            raise NodectlError(f"-o {output}: cannot write the reports: {exc.strerror or exc}") from None
    differences = diff_reports(reports) if diff else None
    if app.json:
        document = {"nodes": reports, "errors": failed}
        if diff:
            document["diff"] = differences
        app.emit_json(document)
    elif diff:
        _print_diff(app, differences, list(reports))
    else:
        _print_table(app, reports)
    for name, error in failed.items():
        app.err.print(f"[red]{name}[/]: {error}")
    if output:
        app.info(f"wrote {len(reports)} report(s) to {output}/")
    if unreachable:
        raise SystemExit(EXIT_UNREACHABLE)
    if failed:
        raise SystemExit(EXIT_FAILED)


SUMMARY = ("os", "kernel", "cpus", "memory", "python", "torch", "cuda", "nccl", "driver", "gpus", "image",
           "host python/torch", "environment")


def nodes_table(reports: dict):
    """One row per node; a column that no node has (cuda, driver on CPU nodes; image without containers) is
    left out."""
    rows = [[escape(name), *(escape(summary_row(report)[c]) for c in SUMMARY)] for name, report in reports.items()]
    columns = [Column("node", key=True), *(Column(c) for c in SUMMARY)]
    return make_table(columns, rows, title="nodes", keep=("node",))


def diff_table(differences: dict, nodes: list[str]):
    rows = [[escape(key), *(escape(str(values.get(node, ""))) for node in nodes)] for key, values in differences.items()]
    return make_table([Column("key"), *(Column(node) for node in nodes)], rows,
                      title=f"{len(differences)} key(s) differ", keep=("key", *nodes))


def _print_table(app: AppContext, reports: dict) -> None:
    app.out.print(nodes_table(reports))


def _print_diff(app: AppContext, differences: dict, nodes: list[str]) -> None:
    if len(nodes) < 2:
        app.out.print("only one node reported: nothing to compare")
        return
    if not differences:
        app.out.print(f"no differences between {len(nodes)} nodes")
        return
    app.out.print(diff_table(differences, nodes))
