"""`nodectl tail TARGET`: a rank's, a node's or every rank's log, during and after a run."""
from __future__ import annotations

import re
import time
from pathlib import Path

import click

from nodectl.resources.launchers import runlayout as layout
from nodectl.cli.context import AppContext
from nodectl.cli.run_option import opened, run_option
from nodectl.errors import EXIT_FAILED, EXIT_UNREACHABLE, UsageError
from nodectl.runs import Run, RunNode
from nodectl.remote.answers import NO_LOG
from nodectl.terminal_text import visible
from nodectl.cli.loglines import printer
from nodectl.watch import LogStream, poll, tail_lines

MAX_TAIL_LINES = 100_000


def resolve_target(run: Run, target: str) -> dict[int, str]:
    """rank<R>, node<K> (node rank), a node name, or all -> {global rank: node name}."""
    run_nodes = run.nodes()
    ranks = {rank: rn.node.name for rn in run_nodes for rank in rn.ranks}
    if target == "all":
        return ranks
    if match := re.fullmatch(r"rank(\d+)", target):
        if int(match[1]) in ranks:
            return {int(match[1]): ranks[int(match[1])]}
    for rn in run_nodes:
        if target in (rn.node.name, f"node{rn.node_rank}"):
            return {rank: rn.node.name for rn2 in [rn] for rank in rn2.ranks}
    valid = ["all", "launcher"] + [f"rank{r}" for r in sorted(ranks)][:16] + [f"node{rn.node_rank}" for rn in run_nodes] \
        + [rn.node.name for rn in run_nodes]
    raise UsageError(f"unknown target {target!r} for run {run.run_id}; valid: {', '.join(dict.fromkeys(valid))}")


def _collected(run: Run, node: str, rank: int) -> Path:
    return run.folder / "nodes" / node / layout.rank_log(rank)


@click.command("tail")
@click.argument("target")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines until the run ends.")
@click.option("-n", "--lines", type=click.IntRange(0, MAX_TAIL_LINES), default=20, show_default=True,
              help=f"Lines per rank (at most {MAX_TAIL_LINES:,}; collect brings whole logs).")
@run_option
@click.pass_obj
def command(app: AppContext, target: str, follow: bool, lines: int, run_id: str | None) -> None:
    """Print the last lines of TARGET's log: rank<R>, node<K>, a node name, all, or launcher (torchrun's own log
    on every node: what it said when it failed before any rank started)."""
    run = opened(app, run_id)
    if target == "launcher":
        _launcher_logs(app, run, lines, follow)
        return
    ranks = resolve_target(run, target)
    run_nodes = [rn for rn in run.nodes() if any(r in rn.ranks for r in ranks)]
    collected: list[dict] = []
    console = app.err if app.json else app.out
    sink = (lambda rank, line: collected.append({"node": ranks[rank], "rank": rank, "line": line})) if app.json \
        else printer(console, ranks, prefixed=len(ranks) > 1)
    stream = LogStream(ranks, sink)
    unreachable = missing = False
    with app.cluster_for(run_nodes) as cluster:
        for rn in run_nodes:
            mine = [r for r in ranks if r in rn.ranks]
            logs = tail_lines(cluster, rn, mine, lines)
            if not logs:
                missing |= logs.no_run and not _from_collected(run, rn, mine, lines, stream, console, logs.no_run)
                unreachable |= not logs.no_run and not _from_collected(run, rn, mine, lines, stream, console)
                continue
            for rank in mine:
                entry = logs.get(rank, NO_LOG)
                stream.offsets[rank] = entry.offset
                for line in entry.text.splitlines():
                    stream.emit(rank, line)
        while follow:
            states = poll(cluster, run_nodes, stream.offsets)
            stream.feed(states)
            if all(r.ok and (r.value.launcher_exit or r.value.alive == 0) for r in states.values()):
                stream.feed(poll(cluster, run_nodes, stream.offsets))
                break
            time.sleep(1.0)
        stream.flush()
    if app.json:
        app.emit_json({"run_id": run.run_id, "target": target, "lines": collected, "complete": not unreachable})
    if unreachable:
        raise SystemExit(EXIT_UNREACHABLE)
    if missing:
        raise SystemExit(EXIT_FAILED)


def _from_collected(run: Run, rn: RunNode, ranks: list[int], lines: int, stream: LogStream, console,
                    no_run: bool = False) -> bool:
    found = False
    for rank in ranks:
        path = _collected(run, rn.node.name, rank)
        if path.is_file():
            found = True
            for line in path.read_text(errors="replace").splitlines()[-lines:] if lines else []:
                stream.emit(rank, line)
    if not found and no_run:
        console.print(f"{rn.node.name} has no folder of run {run.run_id} (removed, or another machine now answers "
                      f"as {rn.node.name}), and its logs were not collected: nothing to show")
    elif not found:
        console.print(f"{rn.node.name} cannot be reached and its logs were not collected")
    return found


def _launcher_logs(app: AppContext, run: Run, lines: int, follow: bool) -> None:
    """Every node's logs/launcher.log (torchrun's and launch.sh's own output), node by node."""
    if follow:
        raise UsageError("tail launcher shows torchrun's own log as it is; -f follows ranks (tail all -f)")
    run_nodes = run.nodes()
    found, unreachable = [], False
    with app.cluster_for(run_nodes) as cluster:
        for rn in run_nodes:
            logs = tail_lines(cluster, rn, ["launcher"], lines)
            if not logs:
                collected = run.folder / "nodes" / rn.node.name / layout.LAUNCHER_LOG
                text = collected.read_text(errors="replace") if collected.is_file() else None
                unreachable |= text is None
                text = "\n".join(text.splitlines()[-lines:]) if text and lines else text
            else:
                text = logs["launcher"].text
            found.append({"node": rn.node.name, "text": text})
    if app.json:
        app.emit_json({"run_id": run.run_id, "target": "launcher", "logs": found, "complete": not unreachable})
    else:
        for entry in found:
            app.heading(f"launcher log of {entry['node']}")
            text = entry["text"]
            app.out.print(visible(text.rstrip("\n")) if text else
                          ("(empty)" if text is not None else "cannot be reached and its logs were not collected"),
                          markup=False, highlight=False)
    if unreachable:
        raise SystemExit(EXIT_UNREACHABLE)
