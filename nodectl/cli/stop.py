"""`nodectl stop`: every process of one run on every node (SIGTERM, SIGKILL after --grace), nothing else."""
from __future__ import annotations

import time
from dataclasses import asdict

import click
from rich.markup import escape

from nodectl.cli.context import AppContext
from nodectl.cli.options import Seconds
from nodectl.cli.run_option import opened, run_option
from nodectl.errors import EXIT_INTERRUPTED, exit_code_for
from nodectl.launch.job import stop_run
from nodectl.runs import RunState, controller_gone
from nodectl.transport import NodeErrorKind
from nodectl.watch import STOP_COMMAND_SLACK, StopHurried


def report_stopped(app: AppContext, results: dict, unstarted: bool = False, run_id: str = "RUN") -> dict:
    """One line per node: what the stop ended there and what is left (`stop`, and a launch's Ctrl-C, say the
    same). Nodes the run never reached are taken out of `results`. Returns the per-node summary for --json."""
    summary = {}
    for name, result in list(results.items()):
        answer = result.value if result.ok else None
        if not answer and unstarted and result.no_run:
            summary[name] = {"left": 0, "absent": True}
            app.info(f"{name}: nothing there (the run never reached it)")
            results.pop(name)
            continue
        if not answer:
            summary[name] = {"error": result.error}
            if result.failure.kind == NodeErrorKind.TIMEOUT:
                app.err.print(f"[red]{escape(result.said)}[/] (its processes may still be being signalled; "
                              f"nodectl stop --run {escape(run_id)} again, or look on the node)")
            else:
                app.err.print(f"[red]{escape(name)}[/]: {escape(result.said.partition(': ')[2])}")
            continue
        summary[name] = asdict(answer)
        if answer.removed:
            app.info(f"{name}: the run folder it had prepared, never started, is removed")
            continue
        if answer.kept:
            app.info(f"{name}: not started this attempt; the run folder, its earlier attempts and outputs are kept")
            continue
        app.info(f"{name}: {answer.terminated} process(es) stopped, {answer.killed} needed SIGKILL, "
                 f"{answer.left} left")
        if answer.unproven:
            pids = ",".join(str(p.pid) for p in answer.unproven)
            named = ", ".join(f"{p.pid} ({p.name}, since {time.strftime('%H:%M:%S', time.localtime(p.started))})"
                              for p in answer.unproven)
            app.err.print(escape(f"{name}: not signalled, not proven the run's: {named}: begun during the run, left "
                                 f"to init, no terminal, no run's marker (a process that escaped before any poll saw "
                                 f"it, or a daemon of yours); look with `ps -o pid,user,lstart,args -p {pids}`"))
    return summary


@click.command("stop")
@run_option
@click.option("--grace", type=Seconds(min=0), default=10.0, show_default=True,
              help="Seconds between SIGTERM and SIGKILL (Ctrl-C ends the wait: SIGKILL at once).")
@click.pass_obj
def command(app: AppContext, run_id: str | None, grace: float) -> None:
    """Stop a run on every node. Safe to repeat."""
    run = opened(app, run_id)
    run_nodes = run.nodes(left_out=True)
    manifest = run.read()
    unstarted = (manifest.failure or {}).get("kind") == "controller" or \
        (manifest.state == RunState.STARTING and controller_gone(manifest))
    app.info(f"stopping run {run.run_id} ({run.folder}) on {len(run_nodes)} node(s)")
    hurried = False
    with app.session() as session:
        try:
            results = stop_run(run, session.cluster(rn.node for rn in run_nodes), grace, RunState.STOPPED,
                               progress=session.progress, remove_unstarted=unstarted, left_out=True, confirmed=True,
                               slack=STOP_COMMAND_SLACK)
        except StopHurried as stopped:
            results, hurried = stopped.results, True
    if hurried:
        app.err.print("interrupted: what was left got SIGKILL without waiting out the grace period")
    summary = report_stopped(app, results, unstarted, run.run_id)
    code = exit_code_for(results.values())
    if app.json:
        app.emit_json({"run_id": run.run_id, "nodes": summary})
    if code or hurried:
        raise SystemExit(code or EXIT_INTERRUPTED)
