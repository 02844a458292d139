"""`nodectl launch`: plan, render, (dry-run stops here), sync, start on every node, then watch or detach."""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import click
from rich.markup import escape
from rich.syntax import Syntax

from nodectl import sync
from nodectl.cli.context import AppContext
from nodectl.cli.options import node_selection
from nodectl.inventory import MAX_RANKS_PER_NODE
from nodectl.errors import (EXIT_FAILED, EXIT_INTERRUPTED, EXIT_UNREACHABLE, INTERRUPTED, RunFailed, UsageError,
                            ignore_signals_while_cleaning)
from nodectl.launch import settle_master_port, start_run, survey
from nodectl.plan import LaunchPlan, build_plan
from nodectl.render import render_plan
from nodectl.secrets import REDACTED, redact_args
from nodectl.resources import resource_dir
from nodectl.runs import Run, create_run, git_revision, open_run
from nodectl.watch import STOP_SLACK, LogStream, poll, stop_nodes, tail_lines, wait_for_end


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


def _print_dry_run(app: AppContext, plan: LaunchPlan, rendered) -> None:
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
@click.option("--grace", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="Seconds between SIGTERM and SIGKILL when stopping.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=0, show_default=True,
              help="After a failure, stop the run everywhere and start it again as its next attempt, up to N times "
                   "(the built-in trainer continues from its latest checkpoint). Needs an attached launch.")
@click.option("--exclude-failed", is_flag=True,
              help="With --max-restarts: before each restart, run the quick preflight on the run's nodes and "
                   "leave out the ones that fail it or are lost; the run goes on with the rest.")
@click.option("--stall-after", type=click.FloatRange(min=1), default=None,
              help="Stop the run when a live rank's heartbeat is older than this many seconds.")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
              help="Override one value of the built-in trainer's recipe (repeatable), e.g. --set train.steps=200.")
@click.option("--resume", "resume_run", metavar="RUN",
              help="Relaunch RUN's plan as its next attempt (the built-in trainer continues from its checkpoint).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.pass_obj
def command(app: AppContext, nodes, exclude, gpus, config, sync_dir, sync_limit, template, dry_run, skip_preflight,
            detach, follow, grace, max_restarts, exclude_failed, stall_after, overrides, resume_run,
            command) -> None:
    """Start SCRIPT (or -m MODULE, or the built-in trainer) through torchrun on every node."""
    previous = None
    if exclude_failed and not max_restarts:
        raise UsageError("--exclude-failed decides which nodes a restart uses: give --max-restarts N too")
    if max_restarts and detach:
        raise UsageError("--max-restarts needs an attached launch: nodectl itself watches the run and restarts it "
                         "(drop --detach)")
    if resume_run:
        previous, inventory, gpus, command, config, sync_dir, max_restarts, overrides = _resume_args(
            app, resume_run, command, config, max_restarts, overrides)
    else:
        inventory = app.inventory().select(nodes, exclude)
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
    facts, preflight = {}, None
    if not skip_preflight and not dry_run:
        from nodectl.preflight.gate import quick_gate

        facts, preflight = quick_gate(app, inventory, gpus)
    options = dict(gpus=gpus, command=command, sync_dir=sync_dir, config=config, max_restarts=max_restarts,
                   overrides=tuple(overrides), facts=facts, run_id=previous.run_id if previous else None)
    plan = _attempt(build_plan(inventory, **options), previous)
    files = files + sync.nodectl_files(plan.builtin_trainer, config)
    rendered = render_plan(plan, template)
    if dry_run:
        _print_dry_run(app, plan, rendered)
        return
    with app.cluster(inventory) as cluster:
        if previous:
            _refuse_if_running(app, previous)
        surveyed = survey(plan, cluster, files)
        shared = surveyed.shared
        if shared:
            app.info(f"{', '.join(sorted(shared))} share a workdir (a network home?): each gets its own run folder")
            plan = _attempt(build_plan(inventory, shared_workdirs=shared, **options), previous)
        plan = settle_master_port(plan, cluster)
        rendered = render_plan(plan, template)
        run = _record_attempt(previous, plan, rendered, app) if previous else \
            _record(plan, rendered, inventory.source, app)
        try:
            if preflight:
                _save_preflight(run, plan, preflight, facts)
            _start(app, run, plan, rendered, cluster, files, grace, surveyed.missing)
            if detach:
                _detached(app, run, plan)
                return
            restarts_left = plan.max_restarts
            while (failure := _watch(app, run, plan, cluster, follow, grace, stall_after)) and restarts_left:
                restarts_left -= 1
                app.err.print(f"[yellow]restarting run {plan.run_id}[/] as attempt {plan.attempt + 1} after: "
                              f"{escape(failure.describe())} ({restarts_left} restart(s) left)")
                attempt = plan.attempt + 1
                left_out = []
                if exclude_failed:
                    plan, left_out = _without_failed_nodes(app, plan, inventory, failure, cluster, gpus, options,
                                                           shared)
                plan = settle_master_port(replace(plan, attempt=attempt), cluster)
                rendered = render_plan(plan, template)
                run = _record_attempt(run, plan, rendered, app)
                if left_out:  # `stop` still reaches them once they are back: their processes may live on
                    run.update(left_out=run.manifest().get("left_out", []) + left_out)
                _start(app, run, plan, rendered, cluster, files, grace)
            if failure:
                _report_failure(app, run, plan, failure)
        except KeyboardInterrupt:
            _interrupted(app, run, plan, cluster, grace)


def _check_recipe(config: str | None, overrides: tuple[str, ...]) -> None:
    """The built-in trainer's recipe, checked here before any node is touched (dry runs too): a typo is exit 2
    now, not a failure on every rank later. Model and data paths name files on the nodes; the ranks check those."""
    recipes = _trainer_config()
    try:
        recipes.load_recipe(config, list(overrides), node_files=False)
    except recipes.ConfigError as exc:
        raise UsageError(f"recipe error: {exc}") from None


def _trainer_config():
    """trainer/config.py, the recipe's one definition (plain Python and yaml: no torch), from nodectl's resources."""
    import importlib.util

    name = "nodectl._trainer_config"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, resource_dir("trainer") / "config.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _without_failed_nodes(app, plan: LaunchPlan, inventory, failure, cluster, gpus, options: dict,
                          shared) -> tuple[LaunchPlan, list[dict]]:
    """The plan for the next attempt without the nodes that fail the quick preflight now (or were lost): node
    ranks closed up in inventory order, a new master if node 0 went. The built-in trainer continues from its
    checkpoint's replica on the smaller world."""
    from nodectl.preflight.run import run_preflight

    current = replace(inventory, nodes=tuple(np.node for np in plan.nodes))
    app.info(f"checking the {len(current.nodes)} node(s) of run {plan.run_id} before the restart (quick preflight)")
    with app.node_progress("checking nodes", len(current.nodes)) as advance:
        report = run_preflight(current, cluster, gpus=gpus, quick=True, full=False,
                               connect_timeout=app.transport_options.connect_timeout, on_probe=advance)
    bad = {name: why for name, why in report.unreachable.items()}
    for result in report.failed:
        bad.setdefault(result.node, f"{result.check}: {result.detail}")
    if failure.kind == "lost":
        bad.setdefault(failure.node, failure.detail)
    kept = [node for node in current.nodes if node.name not in bad]
    if not bad:
        return plan, []
    for name, why in bad.items():
        app.err.print(f"[yellow]leaving out {escape(name)}[/]: {escape(str(why))}")
    if not kept:
        raise RunFailed(f"run {plan.run_id}: no node passed the check before the restart")
    nodes = tuple(replace(node, index=i) for i, node in enumerate(kept))
    names = {node.name for node in nodes}
    left_out = [entry for entry in plan.to_json()["nodes"] if entry["node"]["name"] in bad]
    return build_plan(replace(inventory, nodes=nodes), **{**options, "run_id": plan.run_id,
                                                           "shared_workdirs": frozenset(shared) & names}), left_out


def _attempt(plan: LaunchPlan, previous: Run | None) -> LaunchPlan:
    return replace(plan, attempt=previous.manifest().get("attempt", 0) + 1) if previous else plan


def _save_preflight(run: Run, plan: LaunchPlan, preflight: dict, facts: dict) -> None:
    """The preflight of this attempt (a resumed run keeps the earlier ones as preflight-<attempt>.json)."""
    name = "preflight.json" if plan.attempt == 0 else f"preflight-{plan.attempt}.json"
    (run.folder / name).write_text(json.dumps(preflight, indent=2, default=str))
    env_dir = run.folder / "env"
    env_dir.mkdir(exist_ok=True)
    for node_name, report in facts.items():
        (env_dir / f"{node_name}.json").write_text(json.dumps(report, indent=2, default=str))


def _detached(app: AppContext, run: Run, plan: LaunchPlan) -> None:
    if app.json:
        app.emit_json({"run_id": plan.run_id, "state": "running", "attempt": plan.attempt, "nnodes": plan.nnodes,
                       "world_size": plan.world_size, "folder": str(run.folder.resolve()),
                       "nodes": {np.node.name: np.run_dir for np in plan.nodes}})
        return
    app.out.print(f"run {plan.run_id} started on {plan.nnodes} node(s), world size {plan.world_size}")
    app.out.print(f"follow it:  nodectl tail rank0 -f --run {plan.run_id}")
    app.out.print(f"stop it:    nodectl stop --run {plan.run_id}")


def _refuse_if_running(app: AppContext, previous: Run) -> None:
    """--resume must never touch a run that still has live processes: it would stop them."""
    run_nodes = previous.nodes()
    with app.cluster_for(run_nodes) as cluster:
        states = poll(cluster, run_nodes)
    alive = [name for name, r in states.items() if r.ok and (r.value or {}).get("alive")]
    if alive:
        raise UsageError(f"run {previous.run_id} is still running on {', '.join(alive)}; stop it first "
                         f"(nodectl stop --run {previous.run_id}), then --resume it")


def _resume_args(app: AppContext, run_id: str, command: tuple, config: str | None, max_restarts: int,
                 overrides: tuple[str, ...]):
    """What --resume relaunches: the recorded nodes (with today's inventory settings), ranks, command, config."""
    previous = open_run(run_id)
    manifest = previous.manifest()
    plan = manifest["plan"]
    if command:
        raise UsageError("--resume relaunches the recorded command; give no SCRIPT")
    names = [entry["node"]["name"] for entry in plan["nodes"]]
    current = app.inventory()
    if current.builtin:
        current = current.select(len(names))
    nodes = tuple(replace(current.node(name), index=i) for i, name in enumerate(names))
    inventory = replace(current, nodes=nodes)
    gpus = plan["nodes"][0]["nproc"]
    recorded = tuple(plan["command"])
    if REDACTED in recorded and not plan["builtin_trainer"]:
        raise UsageError(f"run {run_id}'s command held a secret, recorded as {REDACTED}, so it cannot be replayed; "
                         f"launch it again with the secret in the inventory's env: (or the environment) instead")
    if plan["builtin_trainer"]:
        recorded = ()
        config = config or plan.get("config")
    overrides = overrides or tuple(plan.get("overrides") or ())
    return (previous, inventory, gpus, recorded, config, plan["sync_dir"], max_restarts or plan.get("max_restarts", 0),
            overrides)


def _record_attempt(previous: Run, plan: LaunchPlan, rendered, app: AppContext) -> Run:
    manifest = previous.manifest()
    history = manifest.get("attempts", []) + [{"attempt": manifest.get("attempt", 0), "state": manifest.get("state"),
                                                "started": manifest.get("started"), "ended": manifest.get("ended"),
                                                "failure": manifest.get("failure")}]
    previous.update(attempt=plan.attempt, state="starting", attempts=history, ended=None,
                    started=time.time(), plan=plan.to_json(), failure=None)
    for r in rendered:
        (previous.folder / "scripts" / f"{r.node}.sh").write_text(r.launch_redacted)
        (previous.folder / "scripts" / f"{r.node}.env").write_text(r.env_redacted)
    app.info(f"run {plan.run_id}: attempt {plan.attempt} on {plan.nnodes} node(s)")
    return previous


def _record(plan: LaunchPlan, rendered, source: str, app: AppContext) -> Run:
    run = create_run(plan.to_json(), argv=["nodectl", *redact_args(sys.argv[1:])], config_fingerprint=plan.fingerprint(),
                     inventory_source=source, git=git_revision(plan.sync_dir))
    scripts = run.folder / "scripts"
    scripts.mkdir()
    for r in rendered:
        (scripts / f"{r.node}.sh").write_text(r.launch_redacted)
        (scripts / f"{r.node}.env").write_text(r.env_redacted)
    app.info(f"run {plan.run_id}: {plan.nnodes} node(s) x {plan.nodes[0].nproc} rank(s), backend {plan.backend}, "
             f"master {plan.master_addr}:{plan.master_port}")
    return run


def _start(app, run: Run, plan: LaunchPlan, rendered, cluster, files, grace: float,
           missing: dict[str, list[str]] | None = None) -> None:
    began = time.monotonic()

    def ready(prepared) -> None:  # every node has its code and run folder; nothing started yet
        sent = sum(r.value[1] for r in prepared)
        app.info(f"code ready on {len(prepared)} node(s) in {time.monotonic() - began:.1f}s "
                 f"({sent / 2**20:.1f} MiB sent); starting")

    with app.node_progress("syncing and starting", plan.nnodes) as advance:
        results = start_run(plan, rendered, cluster, files, on_done=advance, cancel=INTERRUPTED, missing=missing,
                            on_ready=ready)
    if INTERRUPTED.is_set():
        raise KeyboardInterrupt
    problems = [r for r in results if not r.ok]
    started = {r.node.name: {"pgid": r.value.pgid, "files": r.value.files, "bytes_sent": r.value.bytes_sent}
               for r in results if r.ok}
    if not problems:
        run.set_node_states(started, state="running")
        return
    run.set_node_states(started)
    for r in problems:
        app.err.print(f"[red]{escape(r.node.name)}[/]: {escape(r.error)}")
    app.err.print("stopping the nodes that had started")
    with app.node_progress("stopping", plan.nnodes) as advance:
        stop_nodes(cluster, run.nodes(), grace, on_done=advance)
    run.update(state="failed-to-start", ended=time.time(),
               failure={"kind": "start", "description": "; ".join(f"{r.node.name}: {r.error}" for r in problems)})
    if app.json:
        app.emit_json({"run_id": plan.run_id, "state": "failed-to-start",
                       "nodes": {r.node.name: r.error for r in problems}})
    raise SystemExit(EXIT_UNREACHABLE if any(r.unreachable for r in problems) else EXIT_FAILED)


def _interrupted(app, run: Run, plan: LaunchPlan, cluster, grace: float) -> None:
    """Ctrl-C or SIGTERM at any phase after the run was recorded: stop whatever may have started, say so, 130."""
    ignore_signals_while_cleaning()
    app.err.print(f"interrupted: stopping run {plan.run_id} on every node")
    with app.node_progress("stopping", plan.nnodes) as advance:
        stopped = stop_nodes(cluster, run.nodes(), grace, on_done=advance)
    left = sum((r.value or {}).get("left", 0) for r in stopped.values() if r.ok)
    run.update(state="interrupted", ended=time.time())
    if app.json:
        app.emit_json({"run_id": plan.run_id, "state": "interrupted", "processes_left": left})
    raise SystemExit(EXIT_INTERRUPTED)


def _watch(app, run: Run, plan: LaunchPlan, cluster, follow: str, grace: float, stall_after):
    """Follow the run to its end: None when it succeeded, else its first failure (the run stopped everywhere)."""
    run_nodes = run.nodes()
    ranks = {rank: rn.node.name for rn in run_nodes for rank in rn.ranks}
    followed = ranks if follow == "all" else {0: ranks[0]}
    console = app.err if app.json else app.out
    stream = LogStream(console, followed, prefixed=follow == "all")
    try:
        outcome, failure = wait_for_end(cluster, run_nodes, stream, lost_after=app.transport_options.connect_timeout + 5,
                                        stall_after=stall_after)
    finally:
        stream.flush()
    if outcome == "succeeded":
        run.update(state="succeeded", ended=time.time())
        app.info(f"run {plan.run_id} succeeded")
        if app.json:
            app.emit_json({"run_id": plan.run_id, "state": "succeeded", "attempt": plan.attempt})
        return None
    _stop_failed(app, run, plan, cluster, run_nodes, failure, grace)
    return failure


def _stop_failed(app, run: Run, plan: LaunchPlan, cluster, run_nodes, failure, grace: float) -> None:
    """Fail-fast: stop the run on every node, keep the failing rank's last lines, record the failure."""
    app.err.print(f"[red]{escape(failure.describe())}[/]; stopping the run on every node")
    with app.node_progress("stopping", len(run_nodes)) as advance:
        stopped = stop_nodes(cluster, run_nodes, grace, on_done=advance)
    for name, result in stopped.items():
        if not result.ok or "error" in (result.value or {}):
            app.err.print(f"{escape(name)} is not answering: its processes may still run; when it is back: "
                          f"nodectl stop --run {plan.run_id}")
    if failure.rank is not None:
        rn = next(rn for rn in run_nodes if failure.rank in rn.ranks)
        logs = tail_lines(cluster, rn, [failure.rank], 20, timeout=STOP_SLACK)
        failure.last_lines = logs.get(failure.rank, {}).get("text", "")
    failure.processes_left = {name: (r.value or {}).get("left") for name, r in stopped.items() if r.ok}
    run.update(state="failed", ended=time.time(),
               failure={"kind": failure.kind, "node": failure.node, "rank": failure.rank, "code": failure.code,
                        "detail": failure.detail, "description": failure.describe()})


def _report_failure(app, run: Run, plan: LaunchPlan, failure) -> None:
    if app.json:
        app.emit_json({"run_id": plan.run_id, "state": "failed", "attempt": plan.attempt,
                       "failure": run.manifest()["failure"], "last_lines": failure.last_lines,
                       "processes_left": failure.processes_left})
    else:
        app.err.print(f"[bold red]run {plan.run_id} failed:[/] {escape(failure.describe())}")
        if failure.last_lines:
            app.err.print(f"last lines of rank {failure.rank}:")
            app.err.print(failure.last_lines.rstrip(), markup=False, highlight=False)
        app.err.print(f"all logs: nodectl tail all --run {plan.run_id}   (or nodectl collect --run {plan.run_id})")
    raise SystemExit(EXIT_FAILED)
