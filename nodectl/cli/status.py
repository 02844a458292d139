"""`nodectl status`: per node and rank: running / exited(code) / stalled / lost, heartbeat age, last step and loss, the
share of the recent window each rank was busy or waited in collectives for the others, and the straggler verdict."""
from __future__ import annotations

import time

import click
from rich.markup import escape

from nodectl.cli.context import AppContext
from nodectl.cli.options import Seconds
from nodectl.cli.run_option import opened, refresh_state, run_option
from nodectl import goodput, hardware, pace
from nodectl.errors import exit_code_for
from nodectl.runs import RunState
from nodectl.remote.answers import PollAnswer, RankState
from nodectl.terminal_text import sized, visible
from nodectl.cli.tables import Column, make_table
from nodectl.watch import Failure, FailureKind, failure_lines, poll, rank_failures


def rank_rows(states: dict, run_nodes, stall_after: float) -> list[dict]:
    rows = []
    for rn in run_nodes:
        result = states[rn.node.name]
        answer = result.value if result.ok else None
        if not answer:
            reason = result.error
            state = "not started" if result.no_run else "lost"
            rows += [{"node": rn.node.name, "rank": r, "state": state, "detail": reason} for r in rn.ranks]
            continue
        for rank in answer.ranks:
            rows.append({"node": rn.node.name, "rank": rank.rank, **_rank_state(rank, answer, stall_after)})
    return rows


def rank0_beat(states: dict) -> dict | None:
    """Rank 0's heartbeat as the poll just read it (the current attempt's figures for the goodput ledger)."""
    for result in states.values():
        for rank in (result.value.ranks if result.ok and result.value else ()):
            if rank.rank == 0 and isinstance(rank.heartbeat, dict):
                return rank.heartbeat
    return None


def _said(value) -> str | None:
    """A heartbeat's `warning` (the built-in trainer's: a checkpoint that will not fit): 300 printable characters
    at most, nothing a terminal would act on; None for anything but text."""
    if not isinstance(value, str) or not value:
        return None
    return "".join(c if c.isprintable() else "?" for c in value[:300])


def _number(value):
    """A heartbeat is written by the user's program: only real numbers are shown as numbers."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value else None


def _rank_state(rank: RankState, answer: PollAnswer, stall_after: float) -> dict:
    heartbeat = rank.heartbeat or {}
    # a heartbeat written a moment after the node read its clock (or on a node whose clock runs ahead) is new
    age = None if rank.heartbeat_age is None else max(0.0, rank.heartbeat_age)
    step = heartbeat.get("step")
    row = {"heartbeat_age": age, "step": step if isinstance(step, (int, float, str)) else None,
           "loss": _number(heartbeat.get("loss")), "tokens_per_s": _number(heartbeat.get("tokens_per_s")),
           "warning": _said(heartbeat.get("warning")),
           "pid": rank.pid}
    if rank.exit:
        row["state"], row["exit_code"] = f"exited({rank.exit.code})", rank.exit.code
    elif rank.alive or rank.ending:   # ending: its exit record is being written, it was not killed
        row["state"] = "stalled" if age is not None and age > stall_after else "running"
    elif not answer.started:
        row["state"] = "not started"
    elif answer.alive and rank.pid is None:
        row["state"] = "starting"
    elif answer.same_boot:   # gone without an exit code on a node that never restarted: SIGKILL, the OOM killer
        row["state"] = "killed"
        row["detail"] = ("ended without an exit code while its node stayed up: SIGKILL or the kernel's OOM killer "
                         "(dmesg on the node says which)")
    else:
        row["state"] = "lost"  # gone without an exit code, and the node restarted (or cannot say)
    return row


def _first_failure(manifest, states: dict, run_state: RunState) -> Failure | None:
    """The rank whose last lines explain the run's end: the one the recorded cause names, or, where nodectl
    recorded none (a detached run), the first rank that exited non-zero. None for a run the user stopped or
    interrupted: its ranks died of that stop, which is no failure."""
    failure = manifest.failure if isinstance(manifest.failure, dict) else {}
    if failure.get("kind") in ("interrupted", "controller", "start"):
        return None
    if failure.get("kind") in ("rank", "launcher", "stalled", "lost"):
        rank, node = failure.get("rank"), failure.get("node")
        return Failure(kind=FailureKind(failure["kind"]), node=node if isinstance(node, str) else "",
                       rank=rank if isinstance(rank, int) and not isinstance(rank, bool) else None)
    if run_state == RunState.STOPPED:
        return None
    failures = rank_failures(states)
    return failures[0] if failures else None


def upload_rows(states: dict) -> dict[str, dict]:
    """Per node, its uploader's last round and last error (runs with outputs:)."""
    rows = {}
    for name, result in states.items():
        upload = result.value.upload if result.ok and result.value else None
        if upload is not None:
            rows[name] = {"url": upload.url, "last": upload.last, "rounds": upload.rounds, "files": upload.files,
                          "bytes": upload.bytes, "stored": upload.stored, "waiting": upload.waiting,
                          "final": upload.final, "error": upload.error, "error_time": upload.error_time}
    return rows


def upload_line(name: str, row: dict, now: float) -> str:
    """One node's uploads in words: when the last round ended and what the store holds, then any error."""
    if row["last"] is None:
        said = f"{escape(name)}: no upload round done yet"
    else:
        said = (f"{escape(name)}: last upload {max(0.0, now - row['last']):.0f}s ago"
                f"{' (the final one)' if row['final'] else ''}, {row['stored']} file(s) stored, "
                f"{sized(row['bytes'])} sent in {row['rounds']} round(s)"
                + (f", {row['waiting']} waiting" if row["waiting"] else ""))
    if row["error"]:
        said += f"; [red]upload error[/] {max(0.0, now - (row['error_time'] or now)):.0f}s ago: {escape(row['error'])}"
    return said


def share(value) -> str:
    """A share of the recent window: busy (computing, data, launches), of it getting data (the built-in trainer
    says), or waiting in collectives for other ranks."""
    return "-" if value is None else f"{value * 100:.0f}%"


def render(run_id: str, run_state, rows: list[dict]):
    colour = {"running": "green", "stalled": "yellow", "lost": "red", "starting": "cyan"}
    cells = []
    for row in rows:
        state = row["state"]
        shade = colour.get(state, "green" if state == "exited(0)" else "red")
        age = row.get("heartbeat_age")
        cells.append([escape(row["node"]), str(row["rank"]), f"[{shade}]{escape(state)}[/]",
                      "-" if age is None else f"{max(age, 0):.0f}s ago", escape(str(row.get("step") or "-")),
                      "-" if row.get("loss") is None else f"{row['loss']:.4f}", share(row.get("busy")),
                      share(row.get("data")), share(row.get("in_collectives")), str(row.get("pid") or "-")])
    columns = [Column("node", key=True), Column("rank", "right", key=True), Column("state", whole=True),
               *(Column(name, "right", whole=True) for name in ("heartbeat", "step", "loss", "busy", "data",
                                                                "waits", "pid"))]
    return make_table(columns, cells, title=f"run {run_id} ({run_state})", keep=("node", "rank", "state"))


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
        watch = pace.for_run(run, run_nodes)
        states = poll(cluster, run_nodes, pace=watch, hardware=True)
        rows = rank_rows(states, run_nodes, stall_after)
        uploads = upload_rows(states)
        run_state = refresh_state(run, states)
        manifest = run.read()
        first = _first_failure(manifest, states, run_state)
        if first:
            first.last_lines = failure_lines(cluster, run_nodes, first)
    live = run_state == RunState.RUNNING
    look = watch.look() if live else None
    told, split = pace.current(manifest.pace, look, manifest.attempt) if live else (manifest.pace, {})
    kept = pace.looked_record(manifest.pace, look, manifest.attempt) if live and told is not manifest.pace else None
    if kept is not None:   # no attached launch watches it: what this look saw stays for `runs`
        try:
            run.update(pace=kept)
        except OSError:
            pass
    for row in rows:
        row["busy"], row["in_collectives"], row["data"] = split.get(row["rank"], (None, None, None))
    pace_said = pace.pace_lines(told, live=live)
    spent = goodput.of_run(run, live_beat=rank0_beat(states) if live else None, manifest=manifest)
    cause = manifest.cause or (first.describe() if first else None)
    if app.json:
        app.emit_json({"run_id": run.run_id, "state": run_state, "ranks": rows, "cause": cause,
                       "diagnosis": (manifest.failure or {}).get("diagnosis"),
                       "first_failure": first.__dict__ if first else None, "uploads": uploads,
                       "pace": told, "pace_lines": pace_said, "hardware": hardware.to_json(states),
                       "hardware_lines": hardware.lines(states),
                       "goodput": spent.to_json() if spent else None, "attempts": goodput.story(manifest, spent)})
    else:
        app.out.print(render(run.run_id, run_state, rows))
        for line in pace_said:
            app.out.print(f"[yellow]{escape(line)}[/]" if "straggler:" in line or "slower" in line else escape(line))
        if spent and spent.line(live):
            app.out.print(escape(spent.line(live)))
        for line in goodput.story(manifest, spent):
            app.out.print(escape(line))
        for line in hardware.lines(states):
            app.out.print(f"[red]{escape(line)}[/]" if "cannot go on" in line else escape(line))
        if uploads:
            app.out.print(f"outputs: {escape(manifest.outputs_url or next(iter(uploads.values()))['url'])}")
            for name, row in sorted(uploads.items()):
                app.out.print("  " + upload_line(name, row, time.time()))
        ended = f" at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(manifest.ended))}" if manifest.ended else ""
        if run_state == RunState.STOPPED and not manifest.cause:
            app.out.print(f"stopped by the user{ended}")
        elif cause:
            app.out.print(f"[red]cause:[/] {escape(cause)}{escape(ended) if manifest.cause else ''}")
        diagnosis = (manifest.failure or {}).get("diagnosis") or {}
        if diagnosis.get("folder"):
            app.out.print(f"diagnosis: {escape(str(diagnosis['folder']))}/ (nodectl diagnose shows it again on a "
                          f"live run)")
        for row in rows:
            if row["state"] == "killed":
                app.out.print(f"rank {row['rank']} on {escape(row['node'])}: {escape(row['detail'])}")
            if row.get("warning"):
                app.out.print(f"[yellow]rank {row['rank']} on {escape(row['node'])}:[/] {escape(row['warning'])}")
        if first and first.last_lines:
            app.out.print(f"last lines of rank {first.rank}:" if first.rank is not None else "last lines of torchrun:")
            app.out.print(visible(first.last_lines.rstrip()), markup=False, highlight=False)
    if exit_code_for(states.values()):
        raise SystemExit(exit_code_for(states.values()))
