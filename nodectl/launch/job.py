"""The job stages' work, which the pipeline (nodectl/launch/pipeline.py) runs in order:

    JobSpec --plan_job--> Job (plan + rendered scripts)      Stage.PLAN (`launch --dry-run` stops here)
            --settle_job--> Job (nodes' workdirs surveyed, master port checked)      Stage.SETTLE
            --record_job--> Run (runs/<run_id>/, a new run or the next attempt of one)      Stage.RECORD
            --start_job---> every node synced, then started (or nothing started, and the run says why)  Stage.START

and `stop_run`, the one way a run is stopped and its state recorded (a failure, Ctrl-C, `nodectl stop`).
Like torchx's `schedule(submit_dryrun(...))`: the dry run and the real start are the same calls with the same
inputs. Nothing here prints; callers hear of progress through `progress` and `on_ready`.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

from nodectl.launch.attending import Attending
from nodectl.remote import sync
from nodectl.errors import INTERRUPTED, NodectlError, exit_code_for
from nodectl.inventory import Inventory
from nodectl.launch.nodes import NodeStart, settle_master_port, start_run, survey
from nodectl.plan import LaunchPlan, build_plan
from nodectl.progress import Progress, no_progress
from nodectl.render import RenderedNode, render_plan
from nodectl.runs import Run, RunState, create_run, git_revision, this_controller
from nodectl.secrets import redact_args
from nodectl.transport import Cluster, NodeResult
from nodectl.watch import STOP_SLACK, StopHurried, stop_nodes

@dataclass(frozen=True)
class JobSpec:
    """Everything a job is made from, before any node is read."""

    inventory: Inventory
    command: tuple[str, ...]          # SCRIPT ARGS..., -m MODULE ARGS..., or () for the built-in trainer
    sync_dir: str
    files: tuple[sync.SyncFile, ...]  # what reaches each node: the project's files and nodectl's own
    gpus: int | None = None
    config: str | None = None
    overrides: tuple[str, ...] = ()
    template: str | None = None
    facts: Mapping[str, dict] = field(default_factory=dict)  # probe reports per node, when a preflight ran
    kind: str = "train"               # or "preflight": preflight's own jobs
    argv: tuple[str, ...] = ()        # the command line recorded in the manifest (secrets redacted)
    run_id: str | None = None         # a new id when None
    attempt: int = 0
    shared_workdirs: frozenset[str] = frozenset()
    any_port: bool = False            # --force: a taken master_port moves to a free one instead of failing

    def plan(self) -> LaunchPlan:
        plan = build_plan(self.inventory, gpus=self.gpus, command=self.command, sync_dir=self.sync_dir,
                          config=self.config, run_id=self.run_id,
                          overrides=self.overrides, facts=self.facts, shared_workdirs=self.shared_workdirs)
        return replace(plan, attempt=self.attempt) if self.attempt else plan


@dataclass(frozen=True)
class Job:
    spec: JobSpec
    plan: LaunchPlan
    rendered: tuple[RenderedNode, ...]
    missing: Mapping[str, list[str]] | None = None  # per node, the objects its store lacks (from the survey)

    @property
    def run_id(self) -> str:
        return self.plan.run_id


class StartFailed(NodectlError):
    """Some node could not be prepared or started: the others were stopped and the run records why."""

    def __init__(self, run_id: str, problems: list[NodeResult]) -> None:
        self.run_id, self.problems = run_id, problems
        super().__init__("; ".join(r.said for r in problems))
        self.exit_code = exit_code_for(problems)


def plan_job(spec: JobSpec) -> Job:
    """Plan and render: reads no node. A fixed run id keeps a re-planned job the same run."""
    plan = spec.plan()
    spec = replace(spec, run_id=plan.run_id)
    return Job(spec, plan, tuple(render_plan(plan, spec.template)))


def settle_job(job: Job, cluster: Cluster, *, survey_nodes: bool = True) -> Job:
    """What only the nodes can say: whether their workdirs are one storage (an NFS home: each node then gets a
    subfolder) and which files they lack, then whether node 0 can listen on the master port (a port nodectl
    chose moves when taken). A restart, whose nodes were surveyed already, checks the port alone."""
    spec, missing = job.spec, None
    if survey_nodes:
        surveyed = survey(job.plan, cluster, list(spec.files))
        missing = surveyed.missing
        if surveyed.shared:
            spec = replace(spec, shared_workdirs=surveyed.shared)
        # without a preflight's report (--skip-preflight), what the survey saw of each node's CPUs sizes its
        # OMP_NUM_THREADS: nodes of one machine share its cores
        unprobed = {name: {**spec.facts.get(name, {}), "cpu": cpu} for name, cpu in surveyed.cpus.items()
                    if not (spec.facts.get(name, {}).get("cpu") or {}).get("cpu_set")}
        if unprobed:
            spec = replace(spec, facts={**spec.facts, **unprobed})
    plan = settle_master_port(spec.plan() if spec is not job.spec else job.plan, cluster, move=spec.any_port)
    return Job(spec, plan, tuple(render_plan(plan, spec.template)), missing)


def next_attempt(job: Job, *, inventory: Inventory | None = None) -> Job:
    """The same run's next attempt (on fewer nodes, with `inventory`), planned and rendered."""
    spec = replace(job.spec, attempt=job.plan.attempt + 1)
    if inventory is None:  # the same nodes, ranks and port (settle_job moves a chosen port if it is taken now)
        plan = replace(job.plan, attempt=spec.attempt)
        return Job(spec, plan, tuple(render_plan(plan, spec.template)))
    names = {node.name for node in inventory.nodes}
    return plan_job(replace(spec, inventory=inventory, shared_workdirs=spec.shared_workdirs & names))


def record_job(job: Job, previous: Run | None = None, attending: Attending | None = None) -> Run:
    """The local run folder: a new run, or the next attempt of `previous` (its earlier attempts kept); with
    `attending`, how the launch watches this attempt (what --resume reads back)."""
    plan = job.plan
    watched = {"attending": attending.to_json()} if attending is not None else {}
    if previous is None:
        run = create_run(plan, argv=list(job.spec.argv), config_fingerprint=plan.fingerprint(),
                         inventory_source=job.spec.inventory.source,
                         git=git_revision(plan.sync_dir) if job.spec.kind == "train" else None, kind=job.spec.kind,
                         **watched)
        (run.folder / "scripts").mkdir()
    else:
        run = previous
        manifest = run.read()
        history = manifest.attempts + [{"attempt": manifest.attempt, "state": manifest.state.value,
                                        "started": manifest.started, "ended": manifest.ended,
                                        "failure": manifest.failure}]
        run.update(attempt=plan.attempt, state=RunState.STARTING, attempts=history, ended=None,
                   started=time.time(), plan=plan, failure=None, controller=this_controller(), **watched)
    for r in job.rendered:
        (run.folder / "scripts" / f"{r.node}.sh").write_text(r.launch_redacted)
        (run.folder / "scripts" / f"{r.node}.env").write_text(r.env_redacted)
    return run


def save_preflight(run: Run, attempt: int, preflight: dict, facts: Mapping[str, dict]) -> None:
    """The preflight of this attempt (a resumed run keeps the earlier ones as preflight-<attempt>.json)."""
    name = "preflight.json" if attempt == 0 else f"preflight-{attempt}.json"
    (run.folder / name).write_text(json.dumps(preflight, indent=2, default=str))
    env_dir = run.folder / "env"
    env_dir.mkdir(exist_ok=True)
    for node_name, report in facts.items():
        (env_dir / f"{node_name}.json").write_text(json.dumps(report, indent=2, default=str))


def start_job(job: Job, run: Run, cluster: Cluster, *, grace: float, cancel: threading.Event = INTERRUPTED,
              progress: Progress = no_progress,
              on_ready: Callable[[list[NodeResult]], None] | None = None) -> list[NodeStart]:
    """Sync every node, then start every node. When a node cannot be prepared or started, the nodes that did
    start are stopped, the run is recorded as failed-to-start and StartFailed says why. A cancel (Ctrl-C)
    raises KeyboardInterrupt: the caller stops the run (`stop_run`)."""
    with progress("syncing and starting", job.plan.nnodes) as advance:
        results = start_run(job.plan, list(job.rendered), cluster, list(job.spec.files), on_done=advance,
                            cancel=cancel, missing=job.missing, on_ready=on_ready)
    if cancel.is_set():
        raise KeyboardInterrupt
    problems = results.failed
    started = {name: {"pgid": s.pgid, "files": s.files, "bytes_sent": s.bytes_sent}
               for name, s in results.succeeded.items()}
    if not problems:
        run.set_node_states(started, state=RunState.RUNNING)
        return [r.value for r in results]
    run.set_node_states(started)
    stop_run(run, cluster, grace, RunState.FAILED_TO_START, progress=progress, remove_unstarted=True,
             failure={"kind": "start", "description": "; ".join(r.said for r in problems)})
    raise StartFailed(job.run_id, problems)


def stop_run(run: Run, cluster: Cluster, grace: float, state: RunState, *, progress: Progress = no_progress,
             failure: dict | None = None, remove_unstarted: bool = False, left_out: bool = False,
             confirmed: bool = False, slack: float = STOP_SLACK) -> dict[str, NodeResult]:
    """Stop the run's current attempt on every node (SIGTERM, SIGKILL after `grace`; with `left_out`, also the
    nodes a restart left out) and record `state`, also when a Ctrl-C hurried the stop (StopHurried is raised after
    the record). `remove_unstarted`: the run is being given up before it ran everywhere: a node's folder prepared
    for it but never started is removed. `confirmed` (`nodectl stop`): `state` is recorded only when every node
    confirmed the stop and the run had not ended already."""
    run_nodes = run.nodes(left_out=left_out)
    changes = {"failure": failure} if failure else {}
    results: dict[str, NodeResult] = {}
    try:
        with progress("stopping", len(run_nodes)) as advance:
            results = stop_nodes(cluster, run_nodes, grace, on_done=advance, unstarted=remove_unstarted, slack=slack)
        return results
    except StopHurried as hurried:
        results = hurried.results
        raise
    finally:
        if not confirmed or (results and not exit_code_for(results.values()) and not run.read().state.final):
            run.update(state=state, ended=time.time(), **changes)


def processes_left(stopped: Mapping[str, NodeResult]) -> int:
    return sum(r.value.left for r in stopped.values() if r.ok)


def launch_argv() -> tuple[str, ...]:
    """This command line as the manifest records it: secrets redacted."""
    return ("nodectl", *redact_args(sys.argv[1:]))
