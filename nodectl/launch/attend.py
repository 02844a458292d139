"""Stage.ATTEND: watch a started job to its end, fail fast, restart it, leave out nodes that fail.

Prints nothing. What happens reaches the caller as events (nodectl/launch/events.py, through `notify`); the ranks'
log lines go to the LogStream the caller makes (`stream_for`). A restart goes back through the pipeline's settle,
record and start stages (`restart`).
"""
from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Callable

from nodectl import hardware
from nodectl.goodput import Beats, Timeline
from nodectl.hardware import HardwareNotices
from nodectl.launch.attending import Attending
from nodectl.errors import RunFailed
from nodectl.launch.events import (CheckingNodes, Continuing, Diagnosed, Event, HardwareNote,
                                   HardwareSeen, LeavingOut, NodeLiveness, NotAnswering, NotRestarting,
                                   Restarting, RunPace, Stopping, StragglerHeldBack, StragglerSeen,
                                   UploadTrouble)
from nodectl.pace import PaceWatch, Straggler, for_run
from nodectl.launch.gate import NO_GATE, Gate
from nodectl.launch.job import Job, next_attempt, stop_run
from nodectl.progress import Progress, no_progress
from nodectl.remote.client import NodeClient
from nodectl.remote.liveness import Health, Liveness
from nodectl.secrets import redact_words
from nodectl.runs import Run, RunNode, RunState
from nodectl.transport import Cluster, Session
from nodectl.watch import Failure, FailureKind, LogStream, failure_lines, wait_for_end


Restart = Callable[[Job, list[dict]], tuple[Job, Run]]


class LivenessNotices:
    """Tells nodes' lateness (NodeLiveness) without flooding. A node's first "slow" and its recovery are told; one
    that is late again within `quiet` seconds of its last told "slow" is counted, not told, and its next told "slow"
    says how often it was late meanwhile. What one tick of the watch found goes out as one event per state (`flush`,
    called by the watch after each tick): 64 nodes starved at once are one line, not 64. A node behind a congested
    path flaps every few seconds: at 32 nodes with jitter on 8, a launch printed 36-63 lines in 80 s of watching
    before (bench/watch/watch.py, 2026-11-29). Lost is never damped: it is a verdict (watch.py's Failure), not a
    notice."""

    def __init__(self, notify: Callable[[Event], None], *, quiet: float = 300.0,
                 clock: Callable[[], float] = time.monotonic):
        self.notify, self.quiet, self.clock = notify, quiet, clock
        self.told: dict[str, float] = {}      # node -> when its last "slow" was told
        self.unshown: dict[str, int] = {}     # node -> times it was late since, not told
        self.slow: set[str] = set()           # nodes whose "slow" was told and not yet their recovery
        self.pending: dict[str, list[tuple[str, str]]] = {"slow": [], "up": []}

    def __call__(self, node: str, health: Health) -> None:
        if health.state == Liveness.SLOW:
            now, last = self.clock(), self.told.get(node)
            if last is not None and now - last < self.quiet:
                self.unshown[node] = self.unshown.get(node, 0) + 1
                return
            again = self.unshown.pop(node, 0)
            detail = health.detail + (f"; late {again} more time(s) since it was last shown, {(now - last) / 60:.0f}"
                                      f" min ago" if again else "")
            self.told[node] = now
            self.slow.add(node)
            self.pending["slow"].append((node, detail))
        elif health.state == Liveness.UP and node in self.slow:
            self.slow.discard(node)
            self.pending["up"].append((node, ""))

    def flush(self) -> None:
        for state, told in self.pending.items():
            if told:
                self.notify(NodeLiveness(nodes=tuple(n for n, _ in told), state=state,
                                         details=tuple(d for _, d in told) if state == "slow" else ()))
        self.pending = {"slow": [], "up": []}


class StragglerVerdicts:
    """What the pace verdicts of a run do beyond being told. A verdict is remembered in preflight's history (as the
    part's fault) only when it is certain (Straggler.corroborated: more than the other ranks' own timings support
    it); with `exclude_after`, a certain verdict held that long ends the run so that its node is left out, and an
    uncertain one is told once as not acted on: the run goes on."""

    def __init__(self, run_id: str, gate: Gate, notify: Callable[[Event], None], exclude_after: float | None,
                 continuing: Callable[[str], Continuing] | None = None) -> None:
        self.run_id, self.gate, self.notify, self.exclude_after = run_id, gate, notify, exclude_after
        self.continuing = continuing   # --resume-only: where an attempt without the node would continue from
        self.remembered: set[tuple[int, float]] = set()   # (rank, since) of the verdicts written to the history
        self.held_back: set[tuple[int, float]] = set()    # those exclusion did not act on, told once

    def take(self, straggler: Straggler | None, now: float | None = None) -> Straggler | None:
        """The straggler whose node is to be left out now, if any."""
        if straggler is None or straggler.ended is not None:
            return None
        key = (straggler.rank, straggler.since)
        if straggler.corroborated and key not in self.remembered:
            self.remembered.add(key)
            self.gate.remember_straggler(self.run_id, straggler.to_json())
        now = time.time() if now is None else now
        if self.exclude_after is None or now - (straggler.told or straggler.since) < self.exclude_after:
            return None   # held for --straggler-hold seconds from when it was told (not from when first seen)
        if straggler.corroborated and key in self.held_back:
            return None
        if straggler.corroborated and self.continuing is not None:
            ahead = self.continuing(straggler.node)
            if ahead.checkpoint is None:   # no restart that would not redo the work: the run goes on, told once
                self.held_back.add(key)
                self.notify(NotRestarting(ahead, straggler=True))
                return None
        if straggler.corroborated:
            return straggler
        if key not in self.held_back:
            self.held_back.add(key)
            self.notify(StragglerHeldBack(straggler))
        return None


def attend(job: Job, run: Run, session: Session, attending: Attending, *, restart: Restart,
           stream_for: Callable[[list[RunNode]], LogStream | None] = lambda run_nodes: None,
           notify: Callable[[Event], None] = lambda event: None,
           gate: Gate = NO_GATE) -> tuple[Job, Run, Failure | None]:
    """Watch the started `job` until it succeeds, or fails with no restart left (`attending.max_restarts`): the last
    attempt's job and run, and its failure (None: it succeeded). A failure stops the run on every node first
    (fail-fast); each restart is the same run's next attempt, started by `restart(job, left_out)`."""
    restarts_left = attending.max_restarts
    lost_after = attending.lost_after
    while True:
        excluding = attending.on_straggler == "exclude" and restarts_left > 0
        ahead = (lambda node, job=job, run=run: _continuing(job, run, session, None, without=node)) \
            if attending.resume_only else None
        failure = follow(run, session.cluster(np.node for np in job.plan.nodes), grace=attending.grace,
                         lost_after=lost_after, stall_after=attending.stall_after, keep_stalled=attending.keep_stalled,
                         stream_for=stream_for, notify=notify, progress=session.progress, gate=gate,
                         exclude_after=attending.straggler_hold if excluding else None, continuing=ahead)
        if failure is None or not restarts_left:
            return job, run, failure
        if ahead is not None:
            gone = failure.node if failure.kind in (FailureKind.LOST, FailureKind.STRAGGLER,
                                                    FailureKind.HARDWARE) else None
            before = ahead(gone)
            if before.checkpoint is None:
                notify(NotRestarting(before))
                return job, run, failure
        restarts_left -= 1
        notify(Restarting(job.run_id, failure, job.plan.attempt + 1, restarts_left))
        left_out, inventory = [], None
        if attending.exclude_failed or failure.kind == FailureKind.STRAGGLER:
            inventory, left_out = _passing_nodes(job, failure, session, notify, gate)
        notify(_continuing(job, run, session, inventory))
        job, run = restart(next_attempt(job, inventory=inventory), left_out)


def _continuing(job: Job, run: Run, session: Session, inventory, without: str | None = None) -> Continuing:
    """Where the next attempt continues from: the newest checkpoint of the built-in trainer's that every node of
    it holds complete (the one the trainer resumes from), and the step the last attempt reached, from one poll of
    those nodes (the next attempt's `inventory`, else the run's nodes but `without`). A node that does not answer
    leaves the checkpoint unknown."""
    names = {n.name for n in (inventory.nodes if inventory is not None else (np.node for np in job.plan.nodes))}
    names.discard(without)
    run_nodes = [rn for rn in run.nodes() if rn.node.name in names]
    found = session.cluster(rn.node for rn in run_nodes).fan_out(
        lambda t: NodeClient(t).poll(next(rn.run_dir for rn in run_nodes if rn.node.name == t.node.name), {},
                                     timeout=15, checkpoint=True))
    answers = [r.value for r in found if r.ok]
    steps = [r.step for a in answers for r in a.ranks
             if isinstance(r.step, (int, float)) and not isinstance(r.step, bool)]
    saved = [a.checkpoint for a in answers]
    whole = len(answers) == len(run_nodes) and saved and all(isinstance(c, int) for c in saved)
    return Continuing(run_id=job.run_id, attempt=job.plan.attempt + 1, checkpoint=min(saved) if whole else None,
                      reached=int(max(steps)) if steps else None, builtin=not job.spec.command)


def follow(run: Run, cluster: Cluster, *, grace: float, lost_after: float, stall_after: float | None = None,
           keep_stalled: bool = False,
           stream_for: Callable[[list[RunNode]], LogStream | None] = lambda run_nodes: None,
           notify: Callable[[Event], None] = lambda event: None, progress: Progress = no_progress,
           gate: Gate = NO_GATE, exclude_after: float | None = None,
           continuing: Callable[[str], Continuing] | None = None) -> Failure | None:
    """Follow the run to its end: None when it succeeded, else its first failure (the run stopped everywhere,
    the failing rank's last lines kept). A stall is diagnosed first; with `keep_stalled` the run goes on. The
    ranks' pace is judged all along (nodectl/pace.py): its verdicts are told and kept in the run's record; with
    `exclude_after`, a straggler that keeps its verdict that many seconds ends the run as a failure. `gate` holds
    preflight's history: what its all-reduce gave on these nodes, and where the verdicts are kept too."""
    run_nodes = run.nodes()
    stream = stream_for(run_nodes)
    verdicts: list[dict] = []
    pace = for_run(run, run_nodes) if run.kind != "preflight" else None   # not preflight's own short jobs
    if pace is not None and pace.gpus:
        pace.state.reference = gate.latest_allreduce([rn.node.name for rn in run_nodes])
    recorded = [0.0]
    verdicts_acted = StragglerVerdicts(run.run_id, gate, notify, exclude_after, continuing)
    attempt = run.read().attempt   # the record's pace says whose it is: status trusts only the running attempt's

    def paced(changes: list, watch: PaceWatch) -> Straggler | None:
        for change in changes:
            notify(StragglerSeen(change) if isinstance(change, Straggler) else RunPace(change))
        _keep_window(run, watch)
        if changes or time.time() - recorded[0] >= PACE_RECORD_EVERY:
            recorded[0] = time.time()
            try:
                run.update(pace={**watch.state.to_json(), "attempt": attempt})
            except OSError:
                pass   # the record is the run's; a full disk here must not end the watch
        return verdicts_acted.take(watch.state.straggler)

    told: dict[str, str] = {}

    def uploads(fresh: dict) -> None:   # an uploader that cannot send is said once per node and message
        for name, result in fresh.items():
            upload = result.value.upload if result.ok and result.value else None
            if upload is not None and upload.error and told.get(name) != upload.error:
                told[name] = upload.error
                notify(UploadTrouble(name, upload.error))

    def stalled(failure: Failure) -> bool:
        if stream:
            stream.flush()
        verdicts.append(_diagnose_stall(run, cluster, failure, keep_stalled, notify))
        return not keep_stalled

    parts = HardwareNotices(tell=lambda node, event: notify(HardwareSeen(node, hardware.describe(node, event),
                                                                         event.fatal)),
                            note=lambda node, note: notify(HardwareNote(node, note)),
                            remember=(lambda node, event: gate.remember_hardware(run.run_id, node, event))
                            if run.kind != "preflight" else (lambda node, event: None))

    progress_seen = Beats(Timeline(run.folder), attempt) if run.kind != "preflight" else (lambda fresh: None)

    def answered(fresh: dict) -> None:
        uploads(fresh)
        parts(fresh)
        progress_seen(fresh)

    try:
        outcome, failure = wait_for_end(cluster, run_nodes, stream, lost_after=lost_after, stall_after=stall_after,
                                        on_stall=stalled, pace=pace, on_pace=paced, on_answers=answered,
                                        on_health=LivenessNotices(notify))
    finally:
        if stream:
            stream.flush()
        if isinstance(progress_seen, Beats):
            progress_seen.flush()   # the attempt's last totals: the ledger's figures for it
    if outcome == RunState.SUCCEEDED:
        run.update(state=RunState.SUCCEEDED, ended=time.time())
        return None
    if failure.kind == FailureKind.STALLED:
        failure = _culprit(failure, verdicts[-1] if verdicts else {}, run_nodes)
        # the stalled rank's lines now: once stopped, its log ends in what the stop did to it, not in the cause
        failure.last_lines = failure_lines(cluster, run_nodes, failure)
    notify(Stopping(failure))
    record = {"kind": failure.kind, "node": failure.node, "rank": failure.rank, "code": failure.code,
              "detail": failure.detail, "description": failure.describe()}
    if verdicts and verdicts[-1]:
        record["diagnosis"] = verdicts[-1]
    if failure.node and run.kind != "preflight":
        gate.remember_failure(run.run_id, record)
    stopped = stop_run(run, cluster, grace, RunState.FAILED, progress=progress, failure=record)
    for name, result in stopped.items():
        if not result.ok:
            notify(NotAnswering(name, run.run_id))
    if failure.kind != FailureKind.STALLED:
        failure.last_lines = failure_lines(cluster, run_nodes, failure)
    failure.processes_left = {name: r.value.left for name, r in stopped.items() if r.ok}
    return failure


PACE_RECORD_EVERY = 15.0   # seconds between writes of the pace to the run's record while nothing changes
PACE_SERIES = "pace.jsonl"   # beside the record: each judged window, for `report`'s pace plot


def _keep_window(run: Run, watch: PaceWatch) -> None:
    """The window just judged, one line of runs/<id>/pace.jsonl: each rank's shares, the pace, the straggler."""
    state = watch.state
    line = {"time": round(time.time(), 2), "pace": state.pace, "rate": state.rate, "unit": state.unit,
            "straggler": state.straggler.rank if state.straggler else None,
            "ranks": [{"rank": t.rank, "busy": t.busy, "wait": t.wait, "data": t.data} for t in state.ranks]}
    try:
        with open(run.folder / PACE_SERIES, "a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")
    except OSError:
        pass   # a full disk here must not end the watch


def _culprit(stall: Failure, verdict: dict, run_nodes: list[RunNode]) -> Failure:
    """The stall as its diagnosis tells it: the rank that holds the others up (the first stalled rank is
    usually one of those waiting for it), with the diagnosis's words."""
    culprits = verdict.get("culprits") or []
    if not verdict.get("summary") or verdict.get("kind") in ("healthy", "ended", "unknown"):
        return stall
    rank = culprits[0] if culprits else stall.rank
    node = next((rn.node.name for rn in run_nodes if rank in rn.ranks), stall.node)
    return replace(stall, node=node, rank=rank, diagnosed=redact_words(verdict["summary"]))


def _diagnose_stall(run: Run, cluster: Cluster, failure: Failure, kept: bool, notify) -> dict:
    """The diagnosis of a stall, told as an event; its verdict for the manifest ({} when it could not be made:
    the stop must go on whatever happened here)."""
    from nodectl.diagnose.gather import diagnose

    try:
        diagnosis = diagnose(run, cluster)
    except Exception as exc:  # noqa: BLE001 - a broken diagnosis must not keep a stalled run from being stopped
        notify(Diagnosed(failure, None, kept, f"{type(exc).__name__}: {exc}"))
        return {}
    notify(Diagnosed(failure, diagnosis, kept))
    return {**diagnosis.verdict.to_json(), "folder": str(diagnosis.folder)}


def _passing_nodes(job: Job, failure: Failure, session: Session, notify, gate: Gate):
    """(the inventory of the next attempt, the plan entries left out): the run's nodes without those that
    fail the quick preflight now or were lost; node ranks close up in inventory order, and a new master is
    chosen if node 0 went. None when every node passes. The built-in trainer continues from its checkpoint's
    replica on the smaller world."""
    plan = job.plan
    current = replace(job.spec.inventory, nodes=tuple(np.node for np in plan.nodes))
    # a node the watch found lost (or a certain straggler) is out already: asked again, a half-dead one (its
    # sshd gone, old sessions hanging on a stuck file system) held the check for minutes
    bad = {failure.node: failure.detail} \
        if failure.kind in (FailureKind.LOST, FailureKind.STRAGGLER, FailureKind.HARDWARE) and failure.node else {}
    checked = [node for node in current.nodes if node.name not in bad]
    if checked:
        notify(CheckingNodes(plan.run_id, len(checked)))
        with session.progress("checking nodes", len(checked)) as advance:
            report = gate.check(replace(current, nodes=tuple(replace(node, index=i) for i, node in enumerate(checked))),
                                session, job.spec.gpus, advance)
        bad.update(report.unreachable)
        for result in report.failed:
            bad.setdefault(result.node, f"{result.check}: {result.detail}")
    if not bad:
        return None, []
    for name, why in bad.items():
        notify(LeavingOut(name, str(why)))
    kept = [node for node in current.nodes if node.name not in bad]
    if not kept:
        raise RunFailed(f"run {plan.run_id}: no node passed the check before the restart")
    inventory = replace(current, nodes=tuple(replace(node, index=i) for i, node in enumerate(kept)))
    return inventory, [entry for entry in plan.to_json()["nodes"] if entry["node"]["name"] in bad]
