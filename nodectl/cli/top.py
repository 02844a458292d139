"""`nodectl top`: a live table of every node and rank of a run (state, step, loss, tokens/s, heartbeat age) with
its GPU's utilisation, memory, temperature and power (nvidia-smi on the node), updated in place."""
from __future__ import annotations

import time
from dataclasses import asdict

import click
from rich.console import Group
from rich.live import Live
from rich.markup import escape

from nodectl.cli.context import AppContext
from nodectl.cli.options import Seconds
from nodectl.cli.run_option import opened, refresh_state, run_option
from nodectl import goodput, hardware, pace
from nodectl.cli.status import rank0_beat, rank_rows, share
from nodectl.runs import FINAL_STATES, Run, RunState
from nodectl.cli.tables import Column, make_table
from nodectl.watch import poll


def _gpu_of_ranks(run: Run) -> dict[int, tuple[str, int]]:
    """Global rank -> (node, GPU index as nvidia-smi numbers it): local rank i uses the i-th of the node's
    CUDA_VISIBLE_DEVICES (when it lists indices), else GPU i."""
    out = {}
    for np in run.read().plan.nodes:
        visible = np.env.get("CUDA_VISIBLE_DEVICES", "")
        indices = [int(x) for x in visible.split(",")] if visible and all(
            x.strip().isdigit() for x in visible.split(",")) else None
        for local, rank in enumerate(np.ranks):
            out[rank] = (np.node.name, indices[local] if indices and local < len(indices) else local)
    return out


def snapshot(run: Run, cluster, run_nodes, stall_after: float, watch: pace.PaceWatch) -> dict:
    states = poll(cluster, run_nodes, gpus=True, pace=watch, hardware=True)
    rows = rank_rows(states, run_nodes, stall_after)
    gpus = {}
    for name, result in states.items():
        sample = result.value.gpu_sample if result.ok else None
        gpus[name] = {g.index: asdict(g) for g in (sample.gpus if sample else ())}
    placement = _gpu_of_ranks(run)
    for row in rows:
        node, index = placement.get(row["rank"], (row["node"], None))
        row["gpu"] = gpus.get(node, {}).get(index)
    state = refresh_state(run, states)
    manifest = run.read()
    live = state == RunState.RUNNING
    watch.judge()   # the verdicts of a watch kept across updates (with causes), as an attached launch gives them
    look = watch.state if watch.state.ranks else watch.look()
    told, split = pace.current(manifest.pace, look, manifest.attempt) if live else (manifest.pace, {})
    for row in rows:
        row["busy"], row["in_collectives"], row["data"] = split.get(row["rank"], (None, None, None))
    spent = goodput.of_run(run, live_beat=rank0_beat(states) if live else None, manifest=manifest)
    return {"run_id": run.run_id, "state": state.value, "attempt": manifest.attempt,
            "elapsed_s": round(time.time() - manifest.started, 1) if manifest.started else None,
            "ranks": rows, "pace": told, "pace_lines": pace.pace_lines(told, live=live),
            "hardware": hardware.to_json(states), "hardware_lines": hardware.lines(states),
            "goodput": spent.to_json() if spent else None, "goodput_line": spent.line(live) if spent else ""}


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


COLUMNS = (Column("node", key=True), Column("rank", "right", key=True), Column("state", whole=True),
           *(Column(name, "right", whole=True) for name in ("step", "loss", "tok/s", "beat", "busy", "data", "waits", "gpu",
                                                            "util", "mem GiB", "temp", "power")))


def render(snap: dict):
    """One row per rank; the GPU columns only where a node reported a GPU (not on CPU nodes)."""
    title = f"run {snap['run_id']} ({snap['state']}, attempt {snap['attempt']}"
    title += f", {snap['elapsed_s']:.0f}s)" if snap.get("elapsed_s") is not None else ")"
    colour = {"running": "green", "stalled": "yellow", "lost": "red", "starting": "cyan"}
    rows = []
    for row in snap["ranks"]:
        gpu = row.get("gpu") or {}
        shade = colour.get(row["state"], "green" if row["state"] == "exited(0)" else "red")
        memory = (f"{gpu['mem_used_mib'] / 1024:.1f}/{gpu['mem_total_mib'] / 1024:.0f}"
                  if gpu.get("mem_used_mib") is not None and gpu.get("mem_total_mib") else "-")
        rows.append([escape(row["node"]), str(row["rank"]), f"[{shade}]{escape(row['state'])}[/]",
                     escape(_cell(row.get("step"), "")), _cell(row.get("loss"), ".4f"),
                     _cell(row.get("tokens_per_s"), ",.0f"), _unit(row.get("heartbeat_age"), ".0f", "s"),
                     share(row.get("busy")), share(row.get("data")), share(row.get("in_collectives")),
                     _cell(gpu.get("index"), ""), _unit(gpu.get("util"), ".0f", "%"), memory,
                     _unit(gpu.get("temp_c"), ".0f", "C"), _unit(gpu.get("power_w"), ".0f", "W")])
    table = make_table(COLUMNS, rows, title=title, keep=("node", "rank", "state"))
    said = [f"[yellow]{escape(line)}[/]" for line in snap.get("pace_lines") or ()]
    said += [escape(snap["goodput_line"])] if snap.get("goodput_line") else []
    said += [f"[{'red' if event['fatal'] else 'yellow'}]{escape(line)}[/]"
             for event, line in zip(snap.get("hardware") or (), snap.get("hardware_lines") or ())]
    said += [escape(line) for line in (snap.get("hardware_lines") or ())[len(snap.get("hardware") or ()):]]
    return Group(table, *said) if said else table


def _unit(value, fmt: str, unit: str) -> str:
    return "-" if value is None else format(value, fmt) + unit


@click.command("top")
@run_option
@click.option("--interval", type=Seconds(min=0.5), default=2.0, show_default=True,
              help="Seconds between updates.")
@click.option("--once", is_flag=True, help="Print one table (or, with --json, one document) and exit.")
@click.option("--stall-after", type=Seconds(min=0), default=300.0, show_default=True,
              help="Call a live rank stalled when its heartbeat is older than this (seconds).")
@click.pass_obj
def command(app: AppContext, run_id: str | None, interval: float, once: bool, stall_after: float) -> None:
    """A live view of every rank of a run; ends by itself when the run ends (Ctrl-C leaves earlier)."""
    run = opened(app, run_id)
    run_nodes = run.nodes()
    with app.cluster_for(run_nodes) as cluster:
        watch = pace.for_run(run, run_nodes)
        if once or app.json or not app.out.is_terminal:
            snap = snapshot(run, cluster, run_nodes, stall_after, watch)
            app.emit_json(snap) if app.json else app.out.print(render(snap))
            return
        with Live(console=app.out, auto_refresh=False) as live:
            while True:
                snap = snapshot(run, cluster, run_nodes, stall_after, watch)
                live.update(render(snap), refresh=True)
                if snap["state"] in FINAL_STATES:
                    return
                time.sleep(interval)
