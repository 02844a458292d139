"""`nodectl launch`: the options become a request (nodectl/launch/request.py), the pipeline runs its stages
(nodectl/launch/pipeline.py) over one session of connections, and this file turns its events into output."""
from __future__ import annotations

import click
from rich.markup import escape
from rich.syntax import Syntax

from nodectl import environment as environments
from nodectl.cli.context import AppContext
from nodectl.cli.diagnose import print_diagnosis
from nodectl.cli.loglines import printer
from nodectl.cli.options import declared_options, node_selection
from nodectl.cli.preflight_table import print_report
from nodectl.cli.run_option import opened
from nodectl.cli.stop import report_stopped
from nodectl.errors import EXIT_FAILED, EXIT_INTERRUPTED
from nodectl.inventory import MAX_RANKS_PER_NODE
from nodectl.launch import Outcome, launch, launch_request, stages_for
import nodectl.launch.events as ev
from nodectl.launch.attending import Attending
from nodectl.launch.job import StartFailed, launch_argv, processes_left
from nodectl.preflight.gate import PreflightGate
from nodectl.remote import sync
from nodectl.terminal_text import sized, visible
from nodectl.watch import FailureKind, LogStream


@click.command("launch", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@node_selection
@click.option("--gpus", type=click.IntRange(1, MAX_RANKS_PER_NODE), help="Ranks per node (default: the inventory's gpus).")
@click.option("--config", type=click.Path(exists=True, dir_okay=False), help="Recipe for the built-in trainer.")
@click.option("--sync", "sync_dir", type=click.Path(file_okay=False), default=".", show_default=True,
              help="Folder copied to each node's run folder (.gitignore respected).")
@click.option("--sync-limit", type=click.IntRange(min=1), default=sync.DEFAULT_SYNC_LIMIT // 2**20,
              show_default=True, help="Refuse to sync more than this many MiB.")
@click.option("--template", type=click.Path(dir_okay=False), help="Your own launch script template (Jinja2).")
@click.option("--dry-run", is_flag=True, help="Print the rendered scripts; touch no node.")
@click.option("--skip-preflight", is_flag=True, help="Start without the quick preflight.")
@click.option("--detach", is_flag=True, help="Return once every node has started.")
@click.option("--follow", type=click.Choice(["rank0", "all"]), default="rank0", show_default=True,
              help="Stream rank 0, or every rank prefixed [node/rank].")
@click.option("--force", is_flag=True,
              help="Start even when the inventory's master_port is taken on node 0 (a live run holds it): this run "
                   "gets a free port instead.")
@declared_options(Attending)
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
              help="Override one value of the built-in trainer's recipe (repeatable), e.g. --set train.steps=200.")
@click.option("--environment", "environment", metavar="FILE",
              help="A requirements file or lock in the synced project: every node runs in a venv built from it "
                   "(the inventory's environment:, for this launch).")
@click.option("--outputs", "outputs_url", metavar="URL",
              help="Each node uploads the run's outputs (output/, logs/, metrics/) to URL/<run id>/<node>/ while it "
                   "runs, e.g. s3://bucket/prefix (the inventory's outputs:, for this launch); --resume pulls them "
                   "back to every node.")
@click.option("--resume", "resume_run", metavar="RUN",
              help="Relaunch RUN's plan as its next attempt (the built-in trainer continues from its checkpoint).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.pass_obj
def command(app: AppContext, dry_run: bool, detach: bool, follow: str, **options) -> None:
    """Start SCRIPT (or -m MODULE, or the built-in trainer) through torchrun on every node."""
    attending = Attending.take(options)
    request = launch_request(app.inventory, lambda run_id: opened(app, run_id), argv=launch_argv(), detach=detach,
                             attending=attending, gate=PreflightGate(), **options)
    if request.secret_on_command_line:
        app.err.print("[yellow]warning:[/] an argument looks like a secret: it is shown and stored as ***, but on "
                      "the nodes it sits on the command line, visible to every user there (ps); pass it through "
                      "the inventory's env: instead")
    for withheld in request.withheld:
        app.err.print(f"[yellow]warning:[/] {escape(withheld.name)} is not synced: {escape(withheld.why)}")
    stages = stages_for(dry_run=dry_run, detach=detach, skip_preflight=request.skip_preflight)
    with app.session() as session:
        try:
            outcome = launch(request, session, stages, _shown(app), _log_stream(app, follow))
        except StartFailed as failed:
            _not_started(app, failed)
        except KeyboardInterrupt:   # the pipeline stopped the run and said what was left
            raise SystemExit(EXIT_INTERRUPTED) from None
    if dry_run:
        return
    if not outcome.attended:
        _detached(app, outcome)
    elif outcome.failure:
        _report_failure(app, outcome)
    else:
        app.info(f"run {outcome.job.run_id} succeeded")
        if app.json:
            app.emit_json({"run_id": outcome.job.run_id, "state": "succeeded", "attempt": outcome.job.plan.attempt})


def _shown(app: AppContext):
    """How the launch's events read on the terminal."""
    def show(event: ev.Event) -> None:
        if isinstance(event, ev.EnvironmentsReady):
            _environments_ready(app, event)
        elif isinstance(event, ev.PreflightReused):
            app.info("preflight: reusing a passing report from the last 10 minutes")
        elif isinstance(event, ev.PreflightProbing):
            app.info("preflight (quick): probing every node; --skip-preflight skips this")
        elif isinstance(event, ev.PreflightFailed):
            print_report(app.err, event.report)
        elif isinstance(event, ev.Planned):
            _print_dry_run(app, event)
        elif isinstance(event, ev.SharedWorkdirs):
            app.info(f"{', '.join(event.nodes)} share a workdir (a network home?): each gets its own run folder")
        elif isinstance(event, ev.Recorded):
            _recorded(app, event)
        elif isinstance(event, ev.CodeReady):
            app.info(f"code ready on {event.nodes} node(s) in {event.seconds:.1f}s ({sized(event.sent)} sent); "
                     f"starting")
        elif isinstance(event, ev.Interrupting):
            app.err.print(f"interrupted: stopping run {event.run_id} on every node")
        elif isinstance(event, ev.Interrupted):
            _interrupted(app, event)
        else:
            _attended(app, event)
    return show


def _environments_ready(app: AppContext, event: ev.EnvironmentsReady) -> None:
    done = event.provisioned
    built = sorted(name for name, answer in done.answers.items() if not answer.reused)
    for name, answer in sorted(done.answers.items()):
        if answer.replaced:
            app.err.print(f"[yellow]{escape(name)}[/]: its venv {answer.key} had changed since it was built "
                          f"({', '.join((answer.changed or answer.added or answer.removed)[:3]) or 'files'}...); "
                          f"set aside as {escape(answer.replaced)} and built again")
    first = next(iter(done.answers.values()))
    what = f"built on {', '.join(built)}" if built else "reused on every node"
    fetched = "wheels fetched, " if done.fetched else ""
    app.info(f"environment {environments.describe(first)}: {what} in {event.seconds:.1f}s "
             f"({fetched}{sized(done.sent)} sent)")


def _print_dry_run(app: AppContext, event: ev.Planned) -> None:
    plan, rendered = event.job.plan, event.job.rendered
    if app.json:
        app.emit_json({"plan": plan.to_json(), "scripts": {r.node: {"launch.sh": r.launch_redacted,
                                                                    "env.sh": r.env_redacted}
                                                           for r in rendered}})
        return
    for r in rendered:
        app.heading(f"{escape(r.node)}: launch.sh")
        app.out.print(Syntax(r.launch_redacted, "bash", word_wrap=True) if app.out.is_terminal else r.launch_redacted,
                      markup=False)
        app.heading(f"{escape(r.node)}: env.sh (mode 0600 on the node; secrets shown as ***)")
        app.out.print(r.env_redacted, markup=False, highlight=False)
    app.info(f"dry run: {plan.nnodes} node(s), world size {plan.world_size}; nothing was started")
    for note in event.unsettled:
        app.info(f"  at start, {note}")


def _recorded(app: AppContext, event: ev.Recorded) -> None:
    plan = event.job.plan
    if event.resumed:
        app.info(f"run {plan.run_id}: attempt {plan.attempt} on {plan.nnodes} node(s)")
        return
    app.info(f"run {plan.run_id}: {plan.nnodes} node(s) x {plan.nodes[0].nproc} rank(s), backend "
             f"{plan.backend}, master {plan.master_addr}:{plan.master_port}")
    if plan.outputs:
        app.info(f"outputs: each node uploads to {plan.outputs.run_url(plan.run_id)}<node>/ every "
                 f"{plan.outputs.every:.0f}s and when the run ends (nodectl status shows the last upload)")
    if event.job.spec.command:   # a script of the user's: say where outputs that `collect` brings back go
        app.info("outputs: write them under $NODECTL_OUTPUT_DIR (checkpoints there are on every node "
                 "when the run is resumed); nodectl collect brings them back, and what the script wrote in "
                 "its folder ($NODECTL_RUN_DIR/code)")


def _log_stream(app: AppContext, follow: str):
    console = app.err if app.json else app.out

    def make(run_nodes) -> LogStream:
        ranks = {rank: rn.node.name for rn in run_nodes for rank in rn.ranks}
        followed = ranks if follow == "all" else {0: ranks[0]}
        return LogStream(followed, printer(console, followed, prefixed=follow == "all"))
    return make


def _attended(app: AppContext, event: ev.Event) -> None:
    """The attended run's events."""
    if isinstance(event, ev.Stopping):
        app.err.print(f"[red]{escape(event.failure.describe())}[/]; stopping the run on every node")
    elif isinstance(event, ev.NotAnswering):
        app.err.print(f"{escape(event.node)} is not answering: its processes may still run; when it is back: "
                      f"nodectl stop --run {event.run_id}")
    elif isinstance(event, ev.Restarting):
        app.err.print(f"[yellow]restarting run {event.run_id}[/] as attempt {event.attempt} after: "
                      f"{escape(event.failure.describe())} ({event.restarts_left} restart(s) left)")
    elif isinstance(event, ev.Continuing):
        app.err.print(continuing_line(event))
    elif isinstance(event, ev.NotRestarting):
        ahead = continuing_line(event.continuing)
        app.err.print(f"[yellow]not restarting (--resume-only)[/]: {escape(ahead)}; "
                      + ("the run goes on with its straggler" if event.straggler else "the run ends failed"))
    elif isinstance(event, ev.CheckingNodes):
        app.info(f"checking the {event.count} node(s) of run {event.run_id} before the restart (quick preflight)")
    elif isinstance(event, ev.LeavingOut):
        app.err.print(f"[yellow]leaving out {escape(event.node)}[/]: {escape(event.why)}")
    elif isinstance(event, ev.Diagnosed):
        # the culprit first: the stale heartbeat that noticed the stall is usually rank 0's, one of those waiting
        app.err.print("[red]the run stalled[/]: diagnosing every rank")
        if event.diagnosis is None:
            app.err.print(f"{escape(event.failure.describe())}; the diagnosis failed: {escape(event.error)}")
        else:
            print_diagnosis(app, event.diagnosis, console=app.err, stopping=not event.kept)
            app.err.print(f"[dim](noticed as: {escape(event.failure.describe())})[/]")
        if event.kept:
            app.err.print(f"--on-stall keep: run {event.diagnosis.run_id if event.diagnosis else ''} goes on; "
                          f"stop it with Ctrl-C or nodectl stop")
    elif isinstance(event, ev.StragglerSeen):
        straggler = event.straggler
        if straggler.ended is None:
            app.err.print(f"[yellow]{escape(straggler.describe())}[/]")
        else:
            app.err.print(f"[green]straggler gone[/]: rank {straggler.rank} on node {escape(straggler.node)} keeps "
                          f"pace again (it was {straggler.slower * 100:.0f}% slower for "
                          f"{straggler.ended - straggler.since:.0f}s)")
    elif isinstance(event, ev.StragglerHeldBack):
        straggler = event.straggler
        app.err.print(f"[yellow]--on-straggler exclude: node {escape(straggler.node)} is not left out[/]: the verdict "
                      f"on rank {straggler.rank} is not certain ({escape(straggler.basis)}); the run goes on")
    elif isinstance(event, ev.RunPace):
        app.err.print(f"[yellow]{escape(event.line)}[/]")
    elif isinstance(event, ev.NodeLiveness):
        _liveness(app, event)
    elif isinstance(event, ev.UploadTrouble):
        app.err.print(f"[yellow]outputs: node {escape(event.node)} could not upload[/]: {escape(event.error)} (the run "
                      f"goes on; nodectl status shows the uploader's state)")
    elif isinstance(event, ev.HardwareSeen):
        colour = "red" if event.fatal else "yellow"
        app.err.print(f"[{colour}]hardware:[/] {escape(event.line)}")
    elif isinstance(event, ev.HardwareNote):
        app.err.print(f"hardware: {escape(event.node)}: {escape(event.note)}")
    elif isinstance(event, ev.AttemptRecorded):
        app.info(f"run {event.run_id}: attempt {event.attempt} on {event.nnodes} node(s)")


LIVENESS_NAMED = 4   # nodes named with their lag in one slow notice; the rest counted


def continuing_line(event) -> str:
    """What a restart costs, in words: where the next attempt continues from and what is done again."""
    reached = f" (the last attempt reached step {event.reached:,})" if event.reached else ""
    if event.checkpoint is not None:
        redone = event.reached - event.checkpoint if event.reached and event.reached > event.checkpoint else 0
        again = f"; {redone:,} step(s) are done again" if redone else ""
        return (f"attempt {event.attempt} continues from step {event.checkpoint:,}, the newest checkpoint every "
                f"node of it holds{reached}{again}")
    if event.builtin:
        return (f"attempt {event.attempt} starts from step 0: no checkpoint every node of it holds complete"
                f"{reached}; set train.checkpoint_every to keep one")
    return (f"attempt {event.attempt} runs the script again from its start: nodectl sees no checkpoint of its "
            f"own{reached}; a script that keeps none (under $NODECTL_OUTPUT_DIR, read back at its start) does its "
            f"work so far again")


def _liveness(app: AppContext, event: ev.NodeLiveness) -> None:
    nodes = event.nodes
    if event.state != "slow":
        names = ", ".join(nodes[:LIVENESS_NAMED]) + (f" and {len(nodes) - LIVENESS_NAMED} more"
                                                     if len(nodes) > LIVENESS_NAMED else "")
        app.err.print(f"[green]{'node' if len(nodes) == 1 else 'nodes'} {escape(names)} "
                      f"{'answers' if len(nodes) == 1 else 'answer'} on time again[/]")
        return
    if len(nodes) == 1:
        app.err.print(f"[yellow]node {escape(nodes[0])} is slow[/]: {escape(event.details[0])} (not lost: the run "
                      f"goes on)")
        return
    named = "; ".join(f"{n}: {d}" for n, d in zip(nodes[:LIVENESS_NAMED], event.details))
    more = f"; and {len(nodes) - LIVENESS_NAMED} more" if len(nodes) > LIVENESS_NAMED else ""
    app.err.print(f"[yellow]{len(nodes)} nodes are slow[/]: {escape(named + more)} (not lost: the run goes on; "
                  f"many at once is more often this machine or its network than the nodes)")


def _not_started(app: AppContext, failed: StartFailed) -> None:
    for r in failed.problems:
        name, _, error = r.said.partition(": ")
        app.err.print(f"[red]{escape(name)}[/]: {escape(error)}")
    app.err.print("no node runs it: the nodes it had started were stopped, the folders prepared for it removed "
                  "(a resumed run's folders kept, with every earlier attempt and output)")
    if app.json:
        app.emit_json({"run_id": failed.run_id, "state": "failed-to-start",
                       "nodes": {r.node.name: r.error for r in failed.problems}})
    raise SystemExit(failed.exit_code)


def _detached(app: AppContext, outcome: Outcome) -> None:
    plan, run = outcome.job.plan, outcome.run
    if app.json:
        app.emit_json({"run_id": plan.run_id, "state": "running", "attempt": plan.attempt, "nnodes": plan.nnodes,
                       "world_size": plan.world_size, "folder": str(run.folder.resolve()),
                       "nodes": {np.node.name: np.run_dir for np in plan.nodes}})
        return
    app.out.print(f"run {plan.run_id} started on {plan.nnodes} node(s), world size {plan.world_size}")
    app.out.print(f"follow it:  nodectl tail rank0 -f --run {plan.run_id}")
    app.out.print(f"stop it:    nodectl stop --run {plan.run_id}")


def _interrupted(app: AppContext, event: ev.Interrupted) -> None:
    stopped = dict(event.stopped)
    if event.hurried:
        app.err.print("interrupted again: what was left got SIGKILL without waiting out the grace period")
    left = processes_left(stopped)
    report_stopped(app, stopped, unstarted=True)
    app.err.print(f"run {event.run_id} interrupted: {sum(1 for r in stopped.values() if r.ok)} of {len(stopped)} "
                  f"node(s) stopped, {left} process(es) left")
    if app.json:
        app.emit_json({"run_id": event.run_id, "state": "interrupted", "processes_left": left})


def _report_failure(app: AppContext, outcome: Outcome) -> None:
    failure, run_id = outcome.failure, outcome.job.run_id
    if app.json:
        app.emit_json({"run_id": run_id, "state": "failed", "attempt": outcome.job.plan.attempt,
                       "failure": outcome.run.read().failure, "last_lines": failure.last_lines,
                       "processes_left": failure.processes_left})
    else:
        app.err.print(f"[bold red]run {run_id} failed:[/] {escape(failure.describe())}")
        if failure.last_lines:
            app.err.print(f"last lines of rank {failure.rank}:" if failure.rank is not None else
                          f"last lines of torchrun on {failure.node} (logs/launcher.log):")
            app.err.print(visible(failure.last_lines.rstrip()), markup=False, highlight=False)
        where = "launcher" if failure.kind == FailureKind.LAUNCHER else "all"
        app.err.print(f"all logs: nodectl tail {where} --run {run_id}   (or nodectl collect --run {run_id})")
    raise SystemExit(EXIT_FAILED)
