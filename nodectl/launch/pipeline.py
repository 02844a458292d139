"""One launch, as named stages over one Session:

    PROVISION  the nodes' locked environments built or reused (nodes with environment: only)
    PREFLIGHT  the quick preflight, or a passing report from the last 10 minutes; a failure stops the launch
    PLAN       ranks, ports, addresses and the rendered scripts; reads no node
    SETTLE     what only the nodes can say: shared workdirs, missing files, a free master port
    RECORD     the run folder (a new run, or the recorded run's next attempt)
    START      every node synced, then started; or nothing started, and the run says why (StartFailed)
    ATTEND     followed to its end: fail-fast, stall diagnosis, restarts (which go through SETTLE, RECORD, START)

Each caller chooses its stages: `nodectl launch` all of them (`stages_for`), a dry run PLAN alone, --detach all but
ATTEND, preflight's collective test PLAN to ATTEND. Ctrl-C after RECORD stops whatever may have started, here and
nowhere else, then raises KeyboardInterrupt. Nothing here prints: the caller hears events (nodectl/launch/events.py).
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, replace
from typing import Callable

from nodectl.errors import RunFailed, UnreachableError, UsageError, ignore_signals_while_cleaning
import nodectl.launch.events as ev
from nodectl.goodput import Timeline
from nodectl.launch.attend import attend
from nodectl.launch.job import Job, plan_job, record_job, save_preflight, settle_job, start_job, stop_run
from nodectl.launch.request import LaunchRequest
from nodectl.transport import Session
from nodectl.runs import Run, RunNode, RunState
from nodectl.watch import Failure, LogStream, StopHurried


class Stage(enum.Enum):
    PROVISION = "provision"
    PREFLIGHT = "preflight"
    PLAN = "plan"
    SETTLE = "settle"
    RECORD = "record"
    START = "start"
    ATTEND = "attend"


RESTART = (Stage.SETTLE, Stage.RECORD, Stage.START)


def stages_for(*, dry_run: bool = False, detach: bool = False, skip_preflight: bool = False) -> tuple[Stage, ...]:
    """`nodectl launch`'s stages for its options."""
    if dry_run:
        return (Stage.PLAN,)
    return tuple(stage for stage in Stage
                 if not (stage is Stage.PREFLIGHT and skip_preflight) and not (stage is Stage.ATTEND and detach))


@dataclass(frozen=True)
class Outcome:
    """Where the launch ended: after its last stage (`job` planned, `run` recorded and started), or at the end of
    the attended run (`failure` None: it succeeded)."""
    job: Job
    run: Run | None = None
    failure: Failure | None = None
    attended: bool = False


LogsFor = Callable[[list[RunNode]], LogStream | None]


def launch(request: LaunchRequest, session: Session, stages: tuple[Stage, ...], events: ev.Listener = ev.ignore,
           logs: LogsFor = lambda run_nodes: None) -> Outcome:
    """Run `stages` of `request` in the pipeline's order. Errors the user can act on are NodectlErrors (StartFailed
    when a node could not be started: the run records why, and nothing is left running)."""
    return _Launch(request, session, events, logs).run(stages)


class _Launch:
    def __init__(self, request: LaunchRequest, session: Session, events: ev.Listener, logs: LogsFor) -> None:
        self.request, self.session, self.logs = request, session, logs
        self.began = time.time()   # the goodput ledger's set-up counts from here
        self.told = events
        self.spec = request.spec
        self.preflight: dict | None = None
        self.job: Job | None = None
        self.run_: Run | None = None

    def events(self, event) -> None:
        """Every event to the caller, and what the goodput ledger needs of it to the run's timeline."""
        self._keep(event)
        self.told(event)

    def _keep(self, event) -> None:
        run = self.run_
        if run is None:
            return
        line = Timeline(run.folder)
        attempt = self.job.plan.attempt if self.job is not None else 0
        if isinstance(event, ev.Recorded):
            line.add("launch", attempt, when=self.began, resumed=event.resumed)
        elif isinstance(event, ev.Started):
            line.add("started", attempt)
        elif isinstance(event, ev.Stopping):
            failed = event.failure.time if event.failure.time else None
            line.add("failed", attempt, when=min(failed, time.time()) if failed else None, kind=str(event.failure.kind))
            line.add("noticed", attempt)
        elif isinstance(event, ev.Continuing):
            line.add("continuing", event.attempt, checkpoint=event.checkpoint, reached=event.reached)

    def run(self, stages: tuple[Stage, ...]) -> Outcome:
        unknown = [stage for stage in stages if not isinstance(stage, Stage)]
        if unknown:
            raise TypeError(f"not launch stages: {unknown}")
        if Stage.PROVISION in stages:
            self.provision()
        if Stage.PREFLIGHT in stages:
            self.gate()
        elif not self.request.skip_preflight and not self.spec.facts and Stage.SETTLE not in stages:
            self.cached_preflight()     # a dry run shows what a recent passing report settles
        self.job = plan_job(self.spec)
        if stages[-1] is Stage.PLAN:
            self.events(ev.Planned(self.job, tuple(self.unsettled())))
            return Outcome(self.job)
        if Stage.SETTLE in stages:
            self.settle()
        if Stage.RECORD not in stages:
            return Outcome(self.job)
        self.record()
        try:
            if Stage.START in stages:
                self.start()
            if Stage.ATTEND not in stages:
                return Outcome(self.job, self.run_)
            job, run, failure = attend(self.job, self.run_, self.session, self.request.attending,
                                       restart=self.restart, stream_for=self.logs, notify=self.events,
                                       gate=self.request.gate)
            Timeline(run.folder).add("ended", job.plan.attempt, failed=failure is not None)
            return Outcome(job, run, failure, attended=True)
        except KeyboardInterrupt:
            self.interrupted()
            raise

    def unsettled(self) -> list[str]:
        """What a dry run could not know without reading the nodes, which the launch settles at start."""
        notes, plan = [], self.job.plan
        if not self.spec.facts and not self.request.skip_preflight:
            notes.append("the quick preflight reads each node (ranks per node where gpus: is not set, "
                         "OMP_NUM_THREADS from its CPUs); no passing report from the last 10 minutes to show here")
        if plan.port_was_chosen:
            notes.append(f"master port {plan.master_port} (chosen by nodectl) moves if it is taken on "
                         f"{plan.nodes[0].node.name}")
        notes.append("nodes whose workdirs are one storage (a network home) get a run folder each")
        if any(np.node.environment is not None for np in plan.nodes):
            notes.append("environment: each node's venv is built (or reused) at launch; its ranks then run its python")
        return notes

    def cluster(self):
        return self.session.cluster(self.spec.inventory.nodes if self.job is None else
                                    [np.node for np in self.job.plan.nodes])

    # --- the stages ---------------------------------------------------------------------------------------------

    def provision(self) -> None:
        from nodectl.remote.envs import provision

        inventory = self.spec.inventory
        count = sum(1 for n in inventory.nodes if n.environment is not None)
        if not count:
            return
        began = time.time()
        with self.session.progress("environments", count) as advance:
            done = provision(self.session.cluster(inventory.nodes), inventory, on_done=advance)
        self.spec = replace(self.spec, inventory=done.inventory)
        self.events(ev.EnvironmentsReady(done, time.time() - began))

    def gate(self) -> None:
        """The quick preflight: refuse to start on a failure, reuse a recent passing report."""
        gate, inventory, gpus = self.request.gate, self.spec.inventory, self.spec.gpus
        cached = gate.reusable(inventory, gpus)
        if cached:
            self.events(ev.PreflightReused())
            self.preflight = cached
            self.spec = replace(self.spec, facts=cached["reports"])
            return
        self.events(ev.PreflightProbing(len(inventory.nodes)))
        with self.session.progress("preflight: probing nodes", len(inventory.nodes)) as advance:
            report = gate.check(inventory, self.session, gpus, advance)
        gate.save(report, inventory, gpus)
        if report.unreachable or report.failed:
            self.events(ev.PreflightFailed(report))
            problem = "; ".join(f"{r.node} {r.check}: {r.detail}" for r in report.failed[:3])
            unsafe = any(r.check == "workdir" and r.hint == gate.unsafe_fix for r in report.failed)
            error = UnreachableError if report.unreachable else UsageError if unsafe else RunFailed
            raise error(f"preflight failed, nothing was started ({problem}). Fix it, or --skip-preflight")
        self.preflight = report.to_json()
        self.spec = replace(self.spec, facts=report.reports)

    def cached_preflight(self) -> None:
        cached = self.request.gate.reusable(self.spec.inventory, self.spec.gpus)
        if cached:
            self.spec = replace(self.spec, facts=cached["reports"])

    def settle(self) -> None:
        if self.request.previous:
            self.refuse_if_running(self.request.previous)
        self.job = settle_job(self.job, self.cluster())
        if self.job.spec.shared_workdirs:
            self.events(ev.SharedWorkdirs(tuple(sorted(self.job.spec.shared_workdirs))))

    def refuse_if_running(self, previous: Run) -> None:
        """--resume must never touch a run that still has live processes: it would stop them."""
        from nodectl.watch import poll

        run_nodes = previous.nodes()
        states = poll(self.session.cluster(rn.node for rn in run_nodes), run_nodes)
        alive = [name for name, r in states.items() if r.ok and r.value.alive]
        if alive:
            raise UsageError(f"run {previous.run_id} is still running on {', '.join(alive)}; stop it first "
                             f"(nodectl stop --run {previous.run_id}), then --resume it")

    def record(self) -> None:
        self.run_ = record_job(self.job, self.request.previous, self.request.attending)
        self.events(ev.Recorded(self.job, resumed=self.request.previous is not None))
        if self.preflight:
            save_preflight(self.run_, self.job.plan.attempt, self.preflight, self.spec.facts)

    def start(self, on_ready: bool = True) -> None:
        began = time.monotonic()

        def ready(prepared) -> None:
            self.events(ev.CodeReady(len(prepared), time.monotonic() - began, sum(r.value.sent for r in prepared)))

        start_job(self.job, self.run_, self.cluster(), grace=self.request.attending.grace,
                  progress=self.session.progress,
                  on_ready=ready if on_ready else None)
        self.events(ev.Started(self.job, self.run_))

    def restart(self, job: Job, left_out: list[dict]) -> tuple[Job, Run]:
        """Stage.ATTEND's restart: the next attempt through SETTLE (the port alone: its nodes were surveyed),
        RECORD and START."""
        self.job = settle_job(job, self.cluster(), survey_nodes=False)
        self.run_ = record_job(self.job, self.run_, self.request.attending)
        self.events(ev.AttemptRecorded(self.job.run_id, self.job.plan.attempt, self.job.plan.nnodes))
        if left_out:  # `stop` still reaches them once they are back: their processes may live on
            self.run_.update(left_out=self.run_.read().left_out + left_out)
        self.start(on_ready=False)
        return self.job, self.run_

    def interrupted(self) -> None:
        """Ctrl-C or SIGTERM at any stage after RECORD: stop whatever may have started, and say what was left."""
        ignore_signals_while_cleaning()
        run = self.run_
        self.events(ev.Interrupting(run.run_id))
        cause = {"kind": "interrupted", "description": "interrupted by the user (Ctrl-C or SIGTERM to nodectl): the "
                                                       "run was stopped on every node"}
        hurried = False
        try:
            stopped = stop_run(run, self.cluster(), self.request.attending.grace, RunState.INTERRUPTED,
                               progress=self.session.progress, remove_unstarted=True, failure=cause)
        except StopHurried as hurry:
            stopped, hurried = hurry.results, True
        self.events(ev.Interrupted(run.run_id, stopped, hurried))
