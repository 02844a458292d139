"""`nodectl status`: per node and rank: running / exited(code) / stalled / lost, heartbeat age, last step and loss."""
from __future__ import annotations

import time

import click
from rich.markup import escape
from rich.table import Table

from nodectl.cli.context import AppContext
from nodectl.cli.options import Seconds
from nodectl.cli.runs_cmds import opened, refresh_state, run_option
from nodectl.errors import exit_code_for
from nodectl.runs import RunState
from nodectl.remote.answers import PollAnswer, RankState
from nodectl.visible import visible
from nodectl.watch import failure_lines, poll, rank_failures


def rank_rows(states: dict, run_nodes, stall_after: float) -> list[dict]:
    rows = []
    for rn in run_nodes:
        result = states[rn.node.name]
        answer = result.value if result.ok else None
        if not answer:
            reason = result.error
            state = "not started" if not result.unreachable and "no run at" in (reason or "") else "lost"
            rows += [{"node": rn.node.name, "rank": r, "state": state, "detail": reason} for r in rn.ranks]
            continue
        for rank in answer.ranks:
            rows.append({"node": rn.node.name, "rank": rank.rank, **_rank_state(rank, answer, stall_after)})
    return rows


def _number(value):
    """A heartbeat is written by the user's program: only real numbers are shown as numbers."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value else None


def _rank_state(rank: RankState, answer: PollAnswer, stall_after: float) -> dict:
    heartbeat = rank.heartbeat or {}
    age = rank.heartbeat_age
    step = heartbeat.get("step")
    row = {"heartbeat_age": age, "step": step if isinstance(step, (int, float, str)) else None,
           "loss": _number(heartbeat.get("loss")), "tokens_per_s": _number(heartbeat.get("tokens_per_s")),
           "pid": rank.pid}
    if rank.exit:
        row["state"], row["exit_code"] = f"exited({rank.exit.code})", rank.exit.code
    elif rank.alive:
        row["state"] = "stalled" if age is not None and age > stall_after else "running"
    elif not answer.started:
        row["state"] = "not started"
    elif answer.alive:
        row["state"] = "starting"
    else:
        row["state"] = "lost"  # gone without an exit code: killed with its wrapper, or the node restarted
    return row


@click.command("status")
@run_option
@click.option("--stall-after", type=Seconds(min=0), default=300.0, show_default=True,
              help="Call a live rank stalled when its heartbeat is older than this (seconds).")
@click.pass_obj
def command(app: AppContext, run_id: str | None, stall_after: float) -> None:
    """Show the state of every rank of a run."""
    run = opened(app, run_id)
    run_nodes = run.nodes()
    with app.cluster_for(run_nodes) as cluster:
        states = poll(cluster, run_nodes)
        rows = rank_rows(states, run_nodes, stall_after)
        run_state = refresh_state(run, states)
        # a run the user stopped: its ranks died of stop's SIGTERM, which is no failure to report
        failures = rank_failures(states) if run_state != RunState.STOPPED else []
        first = failures[0] if failures else None
        if first:
            first.last_lines = failure_lines(cluster, run_nodes, first)
    if app.json:
        app.emit_json({"run_id": run.run_id, "state": run_state, "ranks": rows,
                       "first_failure": first.__dict__ if first else None})
    else:
        table = Table(title=f"run {run.run_id} ({run_state})", title_justify="left")
        for column in ("node", "rank", "state", "heartbeat", "step", "loss", "pid"):
            table.add_column(column)
        colour = {"running": "green", "stalled": "yellow", "lost": "red", "starting": "cyan"}
        for row in rows:
            state = row["state"]
            shade = colour.get(state, "green" if state == "exited(0)" else "red")
            age = row.get("heartbeat_age")
            table.add_row(row["node"], str(row["rank"]), f"[{shade}]{state}[/]",
                          "-" if age is None else f"{age:.0f}s ago", str(row.get("step") or "-"),
                          "-" if row.get("loss") is None else f"{row['loss']:.4f}", str(row.get("pid") or "-"))
        app.out.print(table)
        if (run.read().failure or {}).get("kind") == "controller":
            app.out.print(run.read().failure["description"])
        if run_state == RunState.STOPPED:
            ended = run.read().ended
            app.out.print("stopped by the user" + (f" at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(ended))}"
                                                   if ended else ""))
        if first:
            app.out.print(f"[red]first failure:[/] {escape(first.describe())}")
            if first.last_lines:
                app.out.print(visible(first.last_lines.rstrip()), markup=False, highlight=False)
    if exit_code_for(states.values()):
        raise SystemExit(exit_code_for(states.values()))
