"""`nodectl launch`: parse, then the job pipeline (nodectl/job.py: plan, render, [--dry-run stops], settle,
record, start) and the attended run (nodectl/attend.py: follow, fail-fast, restart); this file prints."""
from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import click
from rich.markup import escape
from rich.syntax import Syntax

from nodectl import attend, environment as environments, outputs as stores
from nodectl.remote import sync
from nodectl.cli.context import AppContext
from nodectl.cli.diagnose import print_diagnosis
from nodectl.cli.stop import report_stopped
from nodectl.cli.options import Seconds, node_selection
from nodectl.cli.run_option import opened
from nodectl.errors import EXIT_FAILED, EXIT_INTERRUPTED, UsageError, ignore_signals_while_cleaning
from nodectl.inventory import MAX_RANKS_PER_NODE
from nodectl.plan import LaunchPlan
from nodectl.job import (Job, JobSpec, StartFailed, launch_argv, plan_job, processes_left, record_job, save_preflight,
                         settle_job, start_job, stop_run)
from nodectl.runs import Run, RunState
from nodectl.secrets import REDACTED, redact_args
from nodectl.terminal_text import visible
from nodectl.cli.loglines import printer
from nodectl.watch import LogStream, StopHurried, poll


def _check_command(args: tuple[str, ...], files: list[sync.SyncFile], sync_dir: str) -> tuple[str, ...]:
    """SCRIPT must be a file inside the synced folder (its path made relative to it); -m needs a module."""
    if not args:
        return args
    if args[0] in ("-m", "--module"):
        if len(args) < 2 or not args[1] or args[1].startswith("-"):
            raise UsageError("-m needs a module name: nodectl launch -- -m package.module ARGS")
        return ("-m", *args[1:])
    script = Path(args[0])
    root = Path(sync_dir).resolve()
    absolute = (script if script.is_absolute() else Path.cwd() / script).resolve()
    synced = {f.path for f in files}
    if absolute.is_relative_to(root):
        relative = absolute.relative_to(root).as_posix()
    elif not script.is_absolute() and f"code/{script.as_posix()}" in synced:
        return (script.as_posix(), *args[1:])  # named relative to the synced folder
    else:
        raise UsageError(f"script {args[0]!r} is outside the synced folder {root}: only that folder reaches the "
                         f"nodes; move the script there or sync its folder (--sync DIR)")
    if f"code/{relative}" in synced:
        return (relative, *args[1:])
    if absolute.is_dir():
        raise UsageError(f"script {args[0]!r} is a folder; name a Python file, or a module with -m package.module")
    if not absolute.exists():
        raise UsageError(f"script {args[0]!r} does not exist (looked for {absolute})")
    raise UsageError(f"script {args[0]!r} is excluded from the sync by .gitignore in {root}, so the nodes would not "
                     f"have it; un-ignore it or sync another folder")


def _print_dry_run(app: AppContext, job: Job, unsettled: list[str]) -> None:
    plan, rendered = job.plan, job.rendered
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
    for note in unsettled:
        app.info(f"  at start, {note}")


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
@click.option("--grace", type=Seconds(min=0), default=10.0, show_default=True,
              help="Seconds between SIGTERM and SIGKILL when stopping.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=0, show_default=True,
              help="After a failure, stop the run everywhere and start it again as its next attempt, up to N times "
                   "(the built-in trainer continues from its latest checkpoint). Needs an attached launch.")
@click.option("--exclude-failed", is_flag=True,
              help="With --max-restarts: before each restart, run the quick preflight on the run's nodes and "
                   "leave out the ones that fail it or are lost; the run goes on with the rest.")
@click.option("--stall-after", type=Seconds(min=1), default=None,
              help="A live rank whose heartbeat is older than this many seconds (or, for a script that writes "
                   "none, whose log has not grown for that long) stalls: the run is diagnosed (nodectl diagnose) "
                   "and stopped.")
@click.option("--force", is_flag=True,
              help="Start even when the inventory's master_port is taken on node 0 (a live run holds it): this run "
                   "gets a free port instead.")
@click.option("--on-stall", type=click.Choice(["stop", "keep"]), default="stop", show_default=True,
              help="With --stall-after: after the diagnosis, stop the run, or keep it running (to attach a "
                   "debugger, or wait it out).")
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
def command(app: AppContext, nodes, exclude, gpus, config, sync_dir, sync_limit, template, dry_run, skip_preflight,
            detach, follow, grace, max_restarts, exclude_failed, stall_after, force, on_stall, overrides,
            environment, outputs_url, resume_run, command) -> None:
    """Start SCRIPT (or -m MODULE, or the built-in trainer) through torchrun on every node."""
    previous = None
    for position, argument in enumerate(command, 1):
        try:
            argument.encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError(f"argument {position} after `--` is not UTF-8 text ({os.fsencode(argument)!r}"
                             f"): nodectl records and quotes arguments as UTF-8") from None
    if exclude_failed and not max_restarts:
        raise UsageError("--exclude-failed decides which nodes a restart uses: give --max-restarts N too")
    if on_stall == "keep" and not stall_after:
        raise UsageError("--on-stall keep says what to do with a stall: give --stall-after SECONDS too")
    if stall_after and detach:
        raise UsageError("--stall-after needs an attached launch: nodectl itself watches the heartbeats (on a "
                         "detached run, `nodectl status --stall-after S` and `nodectl diagnose`)")
    if max_restarts and detach:
        raise UsageError("--max-restarts needs an attached launch: nodectl itself watches the run and restarts it "
                         "(drop --detach)")
    if resume_run is not None and not resume_run.strip():
        raise UsageError("--resume: an empty run id (nodectl runs lists them)")
    if resume_run:
        previous, inventory, gpus, command, config, sync_dir, max_restarts, overrides = _resume_args(
            app, resume_run, command, config, max_restarts, overrides)
    else:
        inventory = app.inventory().select(nodes, exclude)
    if outputs_url is not None:
        inventory = inventory.with_outputs(stores.from_option(outputs_url, inventory.outputs))
    inventory = _reachable_addresses(inventory)
    if command and (config or overrides):
        raise UsageError(f"{'--config' if config else '--set'} is for the built-in trainer's recipe; your script "
                         f"takes its own options after its name: nodectl launch -- {command[0]} ...")
    if not command:
        _check_recipe(config, overrides)
    files = sync.project_files(sync_dir, sync_limit * 2**20)
    command = tuple(command) if previous else _check_command(tuple(command), files, sync_dir)
    if redact_args(command) != list(command):
        app.err.print("[yellow]warning:[/] an argument looks like a secret: it is shown and stored as ***, but on "
                      "the nodes it sits on the command line, visible to every user there (ps); pass it through "
                      "the inventory's env: instead")
    config = os.path.abspath(config) if config else None
    if environment:
        inventory = environments.with_environment(inventory, environment)
    inventory = environments.bind_locks(inventory, sync_dir)
    if not dry_run:
        inventory = _provision(app, inventory)
    facts, preflight = _preflight(app, inventory, gpus, skip_preflight, dry_run)
    spec = JobSpec(inventory, command=command, sync_dir=sync_dir,
                   files=tuple(files + sync.nodectl_files(not command, config,
                                                                ("nodectl_outputs.py",) if any(n.outputs for n in inventory.nodes)
                                                                else ())), gpus=gpus, config=config,
                   overrides=tuple(overrides), max_restarts=max_restarts, template=template, facts=facts,
                   argv=launch_argv(), run_id=previous.run_id if previous else None,
                   attempt=previous.read().attempt + 1 if previous else 0, any_port=force)
    job = plan_job(spec)
    if dry_run:
        _print_dry_run(app, job, _unsettled(job, facts, skip_preflight))
        return
    with app.cluster(inventory) as cluster:
        if previous:
            _refuse_if_running(app, previous)
        job = settle_job(job, cluster)
        if job.spec.shared_workdirs:
            app.info(f"{', '.join(sorted(job.spec.shared_workdirs))} share a workdir (a network home?): each gets its "
                     f"own run folder")
        run = record_job(job, previous)
        plan = job.plan
        if previous:
            app.info(f"run {plan.run_id}: attempt {plan.attempt} on {plan.nnodes} node(s)")
        else:
            app.info(f"run {plan.run_id}: {plan.nnodes} node(s) x {plan.nodes[0].nproc} rank(s), backend "
                     f"{plan.backend}, master {plan.master_addr}:{plan.master_port}")
            if plan.outputs:
                app.info(f"outputs: each node uploads to {plan.outputs.run_url(plan.run_id)}<node>/ every "
                         f"{plan.outputs.every:.0f}s and when the run ends (nodectl status shows the last upload)")
            if job.spec.command:   # a script of the user's: say where outputs that `collect` brings back go
                app.info("outputs: write them under $NODECTL_OUTPUT_DIR (checkpoints there are on every node "
                         "when the run is resumed); nodectl collect brings them back, and what the script wrote in "
                         "its folder ($NODECTL_RUN_DIR/code)")
        try:
            if preflight:
                save_preflight(run, plan.attempt, preflight, facts)
            _start(app, job, run, cluster, grace)
            if detach:
                _detached(app, run, job)
                return
            outcome = attend.attend(job, run, cluster, grace=grace, stall_after=stall_after,
                                    keep_stalled=on_stall == "keep",
                                    connect_timeout=app.transport_options.connect_timeout,
                                    exclude_failed=exclude_failed, stream_for=_stream_maker(app, follow),
                                    notify=_printer(app), progress=app.node_progress)
            if outcome.failure:
                _report_failure(app, outcome)
            app.info(f"run {outcome.job.run_id} succeeded")
            if app.json:
                app.emit_json({"run_id": outcome.job.run_id, "state": "succeeded", "attempt": outcome.job.plan.attempt})
        except StartFailed as failed:
            _not_started(app, failed)
        except KeyboardInterrupt:
            _interrupted(app, run, cluster, grace)


def _reachable_addresses(inventory):
    """A node without `addr:` is reached by the others where ssh reaches it: an ~/.ssh/config alias as `host:`
    becomes its HostName (torchrun on the other nodes would retry resolving the alias for ever, silently)."""
    from nodectl.remote.ssh import ssh_hostname

    nodes = tuple(replace(node, addr=ssh_hostname(node.host)) if node.addr == node.host and not node.is_local else node
                  for node in inventory.nodes)
    return replace(inventory, nodes=nodes)


def _provision(app: AppContext, inventory):
    """The locked environments of the nodes that have one (nodectl/environment.py): built or reused, before the
    preflight, which then judges what the ranks will run."""
    from nodectl.remote.envs import provision

    count = sum(1 for n in inventory.nodes if n.environment is not None)
    if not count:
        return inventory
    started = time.time()
    with app.cluster(inventory) as cluster, app.node_progress("environments", count) as advance:
        done = provision(cluster, inventory, on_done=advance)
    built = sorted(name for name, answer in done.answers.items() if not answer.reused)
    for name, answer in sorted(done.answers.items()):
        if answer.replaced:
            app.err.print(f"[yellow]{escape(name)}[/]: its venv {answer.key} had changed since it was built "
                          f"({', '.join((answer.changed or answer.added or answer.removed)[:3]) or 'files'}...); "
                          f"set aside as {escape(answer.replaced)} and built again")
    first = next(iter(done.answers.values()))
    what = f"built on {', '.join(built)}" if built else "reused on every node"
    fetched = "wheels fetched, " if done.fetched else ""
    app.info(f"environment {environments.describe(first)}: {what} in {time.time() - started:.1f}s "
             f"({fetched}{done.sent / 2**20:.1f} MiB sent)")
    return done.inventory


def _preflight(app: AppContext, inventory, gpus, skip: bool, dry_run: bool) -> tuple[dict, dict | None]:
    """(probe reports per node, the preflight document): the quick preflight, or a passing report from the last
    10 minutes. A dry run touches no node: it uses such a report when there is one, as the launch would."""
    from nodectl.cli.preflight_gate import quick_gate
    from nodectl.preflight.run import reusable

    if skip:
        return {}, None
    if dry_run:
        cached = reusable(inventory, gpus)
        return (cached["reports"], cached) if cached else ({}, None)
    return quick_gate(app, inventory, gpus)


def _unsettled(job: Job, facts: dict, skip_preflight: bool) -> list[str]:
    """What the dry run could not know without reading the nodes, which the launch settles at start."""
    notes = []
    if not facts and not skip_preflight:
        notes.append("the quick preflight reads each node (ranks per node where gpus: is not set, "
                     "OMP_NUM_THREADS from its CPUs); no passing report from the last 10 minutes to show here")
    if job.plan.port_was_chosen:
        notes.append(f"master port {job.plan.master_port} (chosen by nodectl) moves if it is taken on "
                     f"{job.plan.nodes[0].node.name}")
    notes.append("nodes whose workdirs are one storage (a network home) get a run folder each")
    if any(np.node.environment is not None for np in job.plan.nodes):
        notes.append("environment: each node's venv is built (or reused) at launch; its ranks then run its python")
    return notes


def _stream_maker(app: AppContext, follow: str):
    console = app.err if app.json else app.out

    def make(run_nodes) -> LogStream:
        ranks = {rank: rn.node.name for rn in run_nodes for rank in rn.ranks}
        followed = ranks if follow == "all" else {0: ranks[0]}
        return LogStream(followed, printer(console, followed, prefixed=follow == "all"))
    return make


def _printer(app: AppContext):
    """How the attended run's events read on the terminal."""
    def show(event) -> None:
        if isinstance(event, attend.Stopping):
            app.err.print(f"[red]{escape(event.failure.describe())}[/]; stopping the run on every node")
        elif isinstance(event, attend.NotAnswering):
            app.err.print(f"{escape(event.node)} is not answering: its processes may still run; when it is back: "
                          f"nodectl stop --run {event.run_id}")
        elif isinstance(event, attend.Restarting):
            app.err.print(f"[yellow]restarting run {event.run_id}[/] as attempt {event.attempt} after: "
                          f"{escape(event.failure.describe())} ({event.restarts_left} restart(s) left)")
        elif isinstance(event, attend.CheckingNodes):
            app.info(f"checking the {event.count} node(s) of run {event.run_id} before the restart (quick preflight)")
        elif isinstance(event, attend.LeavingOut):
            app.err.print(f"[yellow]leaving out {escape(event.node)}[/]: {escape(event.why)}")
        elif isinstance(event, attend.Diagnosed):
            app.err.print(f"[red]{escape(event.failure.describe())}[/]; diagnosing every rank")
            if event.diagnosis is None:
                app.err.print(f"the diagnosis failed: {escape(event.error)}")
            else:
                print_diagnosis(app, event.diagnosis, console=app.err)
            if event.kept:
                app.err.print(f"--on-stall keep: run {event.diagnosis.run_id if event.diagnosis else ''} goes on; "
                              f"stop it with Ctrl-C or nodectl stop")
        elif isinstance(event, attend.AttemptRecorded):
            app.info(f"run {event.run_id}: attempt {event.attempt} on {event.nnodes} node(s)")
    return show


def _check_recipe(config: str | None, overrides: tuple[str, ...]) -> None:
    """The built-in trainer's recipe, checked here before any node is touched (dry runs too): a typo is exit 2
    now, not a failure on every rank later. Model and data paths name files on the nodes; the ranks check those."""
    recipes = _trainer_config()
    try:
        recipes.load_recipe(config, list(overrides), node_files=False)
    except recipes.ConfigError as exc:
        raise UsageError(f"recipe error: {exc}") from None


def _trainer_config():
    """trainer/config.py, the recipe's one definition (plain Python and yaml: no torch)."""
    from nodectl.resources.trainer import config
    return config


def _refuse_if_running(app: AppContext, previous: Run) -> None:
    """--resume must never touch a run that still has live processes: it would stop them."""
    run_nodes = previous.nodes()
    with app.cluster_for(run_nodes) as cluster:
        states = poll(cluster, run_nodes)
    alive = [name for name, r in states.items() if r.ok and r.value.alive]
    if alive:
        raise UsageError(f"run {previous.run_id} is still running on {', '.join(alive)}; stop it first "
                         f"(nodectl stop --run {previous.run_id}), then --resume it")


def _resume_args(app: AppContext, run_id: str, command: tuple, config: str | None, max_restarts: int,
                 overrides: tuple[str, ...]):
    """What --resume relaunches: the recorded nodes (with today's inventory settings), ranks, command, config."""
    previous = opened(app, run_id)
    plan = LaunchPlan.from_json(previous.read().plan, f"run {previous.run_id}'s record")
    if command:
        raise UsageError("--resume relaunches the recorded command; give no SCRIPT")
    current = app.inventory()
    if current.builtin:
        current = current.select(plan.nnodes)
    nodes = tuple(_recorded_settings(replace(current.node(np.node.name), index=i), np.node)
                  for i, np in enumerate(plan.nodes))
    recorded = plan.command
    if REDACTED in recorded and not plan.builtin_trainer:
        raise UsageError(f"run {run_id}'s command held a secret, recorded as {REDACTED}, so it cannot be replayed; "
                         f"launch it again with the secret in the inventory's env: (or the environment) instead")
    if plan.builtin_trainer:
        recorded = ()
        config = config or plan.config
    return (previous, replace(current, nodes=nodes), plan.nodes[0].nproc, recorded, config, plan.sync_dir,
            max_restarts or plan.max_restarts, overrides or plan.overrides)


def _recorded_settings(node, recorded):
    """Today's inventory settings for a node of the run, with what the run recorded where today's say nothing: a
    run launched with --environment resumes in a venv of the same file (built again if it changed), and the run's
    bucket is found again from fresh nodes."""
    if recorded.outputs is not None and node.outputs is None:
        node = replace(node, outputs=recorded.outputs)
    if node.environment is not None or node.container is not None or recorded.environment is None:
        return node
    if REDACTED in str(recorded.environment.index_url or ""):
        raise UsageError(f"{node.name}: the run's environment index held credentials, recorded as {REDACTED}; set "
                         f"environment: {{file: ..., install: index, index_url: ...}} for it in hosts.yaml and resume")
    return replace(node, environment=recorded.environment)


def _start(app: AppContext, job: Job, run: Run, cluster, grace: float) -> None:
    began = time.monotonic()

    def ready(prepared) -> None:  # every node has its code and run folder; nothing started yet
        sent = sum(r.value.sent for r in prepared)
        app.info(f"code ready on {len(prepared)} node(s) in {time.monotonic() - began:.1f}s "
                 f"({sent / 2**20:.1f} MiB sent); starting")

    start_job(job, run, cluster, grace=grace, progress=app.node_progress, on_ready=ready)


def _not_started(app: AppContext, failed: StartFailed) -> None:
    for r in failed.problems:
        name, _, error = r.said.partition(": ")
        app.err.print(f"[red]{escape(name)}[/]: {escape(error)}")
    app.err.print("no node runs it: the nodes it had started were stopped, the folders prepared for it removed")
    if app.json:
        app.emit_json({"run_id": failed.run_id, "state": "failed-to-start",
                       "nodes": {r.node.name: r.error for r in failed.problems}})
    raise SystemExit(failed.exit_code)


def _detached(app: AppContext, run: Run, job: Job) -> None:
    plan = job.plan
    if app.json:
        app.emit_json({"run_id": plan.run_id, "state": "running", "attempt": plan.attempt, "nnodes": plan.nnodes,
                       "world_size": plan.world_size, "folder": str(run.folder.resolve()),
                       "nodes": {np.node.name: np.run_dir for np in plan.nodes}})
        return
    app.out.print(f"run {plan.run_id} started on {plan.nnodes} node(s), world size {plan.world_size}")
    app.out.print(f"follow it:  nodectl tail rank0 -f --run {plan.run_id}")
    app.out.print(f"stop it:    nodectl stop --run {plan.run_id}")


def _interrupted(app: AppContext, run: Run, cluster, grace: float) -> None:
    """Ctrl-C or SIGTERM at any phase after the run was recorded: stop whatever may have started, say so, 130."""
    ignore_signals_while_cleaning()
    app.err.print(f"interrupted: stopping run {run.run_id} on every node")
    cause = {"kind": "interrupted", "description": "interrupted by the user (Ctrl-C or SIGTERM to nodectl): the run "
                                                   "was stopped on every node"}
    try:
        stopped = stop_run(run, cluster, grace, RunState.INTERRUPTED, progress=app.node_progress,
                           remove_unstarted=True, failure=cause)
    except StopHurried as hurried:
        app.err.print("interrupted again: what was left got SIGKILL without waiting out the grace period")
        stopped = hurried.results
    left = processes_left(stopped)
    report_stopped(app, dict(stopped), unstarted=True)
    app.err.print(f"run {run.run_id} interrupted: {sum(1 for r in stopped.values() if r.ok)} of {len(stopped)} "
                  f"node(s) stopped, {left} process(es) left")
    if app.json:
        app.emit_json({"run_id": run.run_id, "state": "interrupted", "processes_left": left})
    raise SystemExit(EXIT_INTERRUPTED)


def _report_failure(app: AppContext, outcome: attend.Outcome) -> None:
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
        where = "launcher" if failure.kind == "launcher" else "all"
        app.err.print(f"all logs: nodectl tail {where} --run {run_id}   (or nodectl collect --run {run_id})")
    raise SystemExit(EXIT_FAILED)
