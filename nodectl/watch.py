"""Watching a run: polling every node over its open connection, streaming logs, fail-fast, stop."""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

from nodectl import hardware
from nodectl.errors import interruptible, uninterruptible
from nodectl.pace import PaceWatch, Straggler
from nodectl.resources.launchers import runlayout as layout
from nodectl.remote.answers import NO_LOG, LogChunk
from nodectl.remote.liveness import Health, Liveness
from nodectl.remote.poller import Poller
from nodectl.runs import RunNode, RunState
from nodectl.transport import Cluster, NodeResult
from nodectl.remote.client import NodeClient



class FailureKind(str, Enum):
    """How a run failed: the record's failure `kind`, equal to its name as the records spell it."""
    RANK = "rank"              # a rank exited with an error
    LAUNCHER = "launcher"      # torchrun itself (or its processes vanished without an exit code)
    LOST = "lost"              # a node stopped answering
    STALLED = "stalled"        # no step for --stall-after
    STRAGGLER = "straggler"    # --on-straggler exclude acted on a verdict that held
    HARDWARE = "hardware"      # a part of the run became unusable (an Xid that needs a reset, a GPU lost)

    def __str__(self) -> str:
        return self.value


@dataclass(kw_only=True)
class Failure:
    kind: FailureKind
    node: str
    rank: int | None = None
    code: int | None = None
    time: float = 0.0        # when, in seconds since the epoch (a rank's or torchrun's exit: the node's clock)
    detail: str = ""
    last_lines: str = ""
    processes_left: dict = field(default_factory=dict)
    diagnosed: str = ""      # a stall's diagnosis, naming the rank that holds the others up
    evidence: str = ""       # what else was seen and points at this cause (survivors' failures after a node was lost)

    def describe(self) -> str:
        said = self._said()
        return f"{said}; {self.evidence}" if self.evidence else said

    def _said(self) -> str:
        if self.kind == FailureKind.STALLED and self.diagnosed:
            return f"stalled: {self.diagnosed}"
        if self.kind == FailureKind.RANK:
            how = f"exit code {self.code}" if self.code is not None and self.code >= 0 else \
                f"killed by {_signal_name(-self.code)}" if self.code is not None else "failed"
            return f"rank {self.rank} on node {self.node} failed ({how})"
        if self.kind == FailureKind.LOST:
            return f"node {self.node} was lost: {self.detail}"
        if self.kind == FailureKind.STALLED:
            return f"rank {self.rank} on node {self.node} stalled: {self.detail}"
        if self.kind in (FailureKind.STRAGGLER, FailureKind.HARDWARE):
            return self.detail
        if self.code is None:
            return f"node {self.node}: {self.detail}"
        return f"node {self.node}: torchrun exited {self.code} {self.detail}".rstrip()


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def poll(cluster: Cluster, run_nodes: list[RunNode], offsets: dict[int, int] | None = None,
         gpus: bool = False, pace: PaceWatch | None = None, hardware: bool = False) -> dict[str, NodeResult]:
    """Every node's state of the run (and new log text from `offsets`; with `gpus`, an nvidia-smi sample; with
    `hardware`, its parts' events since the run started); with `pace`, what it asks of the ranks' pace, and each
    answer fed to it."""
    by_name = {rn.node.name: rn for rn in run_nodes}

    def work(transport):
        rn = by_name[transport.node.name]
        wanted = {str(r): o for r, o in (offsets or {}).items() if r in rn.ranks}
        since, detail = pace.request(rn.node.name, list(rn.ranks)) if pace else (None, False)
        sent = time.time()
        answer = NodeClient(transport).poll(rn.run_dir, wanted, gpus=gpus, pace=since, gpu_detail=detail,
                                            timeout=30, hardware=hardware)
        if pace:
            pace.feed(rn.node.name, answer, time.time(), sent)
        return answer

    return {r.node.name: r for r in cluster.fan_out(work, [rn.node for rn in run_nodes])}


# Seconds beyond the grace a node gets to confirm a stop: runctl needs at most grace + ~6 on an idle node. The
# launch's fail-fast stop waits STOP_SLACK (a node that does not confirm is named and the failure reported);
# `nodectl stop`, which the user asked for and waits on, gives a busy node (ending eight ranks) STOP_COMMAND_SLACK.
STOP_SLACK = 10.0
STOP_COMMAND_SLACK = 30.0


class StopHurried(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) while a stop waited out its grace period: what was left got SIGKILL at once instead.
    `results` holds every node's answer, as stop_nodes returns them."""

    def __init__(self, results: dict[str, NodeResult]):
        super().__init__()
        self.results = results


def stop_nodes(cluster: Cluster, run_nodes: list[RunNode], grace: float,
               on_done=None, unstarted: bool = False, slack: float = STOP_SLACK) -> dict[str, NodeResult]:
    """Stop the run on every node, waiting at most grace + `slack` on each: a hung node must not hold up the
    report; its result then says it did not answer. `unstarted`: the run never started (its controller died
    while starting it): a node's prepared or half-prepared folder is removed.

    A Ctrl-C while the nodes wait out the grace period (also one the caller would otherwise ignore) does not wait
    for them: every node not yet done is asked again with no grace, so what is left gets SIGKILL now, and
    StopHurried carries the answers."""
    by_name = {rn.node.name: rn for rn in run_nodes}
    answered: dict[str, NodeResult] = {}

    def stop_all(nodes: list, seconds: float, done) -> dict[str, NodeResult]:
        def work(transport):
            rn = by_name[transport.node.name]
            return NodeClient(transport).stop(rn.run_dir, seconds, unstarted, timeout=seconds + slack)

        return {r.node.name: r for r in cluster.fan_out(work, nodes, on_done=done, abandon_on_interrupt=True)}

    def done(result: NodeResult) -> None:
        answered[result.node.name] = result
        if on_done:
            on_done(result)

    try:
        with interruptible():
            return stop_all([rn.node for rn in run_nodes], grace, done)
    except KeyboardInterrupt:
        first = dict(answered)
        with uninterruptible():
            rest = stop_all([rn.node for rn in run_nodes if rn.node.name not in first], 0.0, on_done)
        merged = {**first, **rest}
        raise StopHurried({rn.node.name: merged[rn.node.name] for rn in run_nodes}) from None


def tail_lines(cluster: Cluster, run_node: RunNode, ranks: list[int | str], lines: int,
               timeout: float = 30) -> dict[int | str, LogChunk]:
    """The last `lines` lines of these ranks' logs ("launcher": torchrun's own log) on one node; {} when the node
    did not answer."""
    result = cluster.fan_out(lambda t: NodeClient(t).tail(run_node.run_dir, ranks, lines, timeout=timeout),
                             [run_node.node])[0]
    if not result.ok:
        return NodeLogs(no_run=result.no_run)
    return NodeLogs({int(rank) if rank.isdigit() else rank: entry for rank, entry in result.value.logs.items()})


class NodeLogs(dict):
    """A node's logs by rank; empty when it did not answer, or (`no_run`) answered that it has no such run
    (its folder removed, or a node that replaced the one the run used)."""

    def __init__(self, logs=(), no_run: bool = False) -> None:
        super().__init__(logs)
        self.no_run = no_run


def failure_lines(cluster: Cluster, run_nodes: list[RunNode], failure: Failure, lines: int = 20) -> str:
    """The last lines that explain a failure: the failing rank's log, or, when torchrun failed before any rank
    (a port in use, a bad argument), its own log on that node."""
    if failure.rank is not None:
        run_node, key = next((rn for rn in run_nodes if failure.rank in rn.ranks), None), failure.rank
    elif failure.kind == FailureKind.LAUNCHER:
        run_node, key = next((rn for rn in run_nodes if rn.node.name == failure.node), None), "launcher"
    else:
        return ""
    if run_node is None:
        return ""
    text = tail_lines(cluster, run_node, [key], lines, timeout=STOP_SLACK).get(key, NO_LOG).text
    return "\n".join(latest_state(line) for line in text.split("\n"))   # a progress bar: its last state


def rank_failures(states: dict[str, NodeResult]) -> list[Failure]:
    """Ranks that exited non-zero, and torchruns that failed without any rank failing, oldest first."""
    failures = []
    for name, result in states.items():
        answer = result.value if result.ok else None
        if not answer:
            continue
        failed_ranks = [Failure(kind=FailureKind.RANK, node=name, rank=rank.rank, code=rank.exit.code,
                                time=rank.exit.time) for rank in answer.ranks if rank.exit and rank.exit.code != 0]
        launcher = answer.launcher_exit
        if failed_ranks:
            failures += failed_ranks
        elif launcher and launcher.code != 0:
            failures.append(Failure(kind=FailureKind.LAUNCHER, node=name, code=launcher.code, time=launcher.time,
                                    detail="(see logs/launcher.log on the node)"))
    return sorted(failures, key=lambda f: (f.time, f.rank if f.rank is not None else 1 << 30))


def derive_state(states: dict[str, NodeResult]) -> RunState | None:
    """What a run is, from every node's answer: running, succeeded, failed, stopped, or lost (its processes
    are gone and no torchrun recorded an exit: a reboot, or killed from outside). None if a node did not answer."""
    answers = [r.value for r in states.values() if r.ok and r.value]
    if len(answers) < len(states) or not answers:
        return None
    if any(a.alive for a in answers):
        return RunState.RUNNING
    exits = [a.launcher_exit for a in answers]
    if all(e and e.code == 0 for e in exits):
        return RunState.SUCCEEDED
    if any(a.stopped for a in answers):
        return RunState.STOPPED
    if any(e and e.code != 0 for e in exits):
        return RunState.FAILED
    return RunState.LOST


def finished_ok(states: dict[str, NodeResult]) -> bool:
    answers = [r.value for r in states.values() if r.ok and r.value]
    return len(answers) == len(states) and all(a.launcher_exit and a.launcher_exit.code == 0 for a in answers)


LINE_MAX = layout.LINE_MAX   # the node cuts a longer line the same way (runctl's poll and tail)


def latest_state(line: str) -> str:
    """What a terminal would show of a line that redraws itself with \\r (tqdm): the text after the last \\r."""
    line = line.rstrip("\r")
    return line.rsplit("\r", 1)[-1] if "\r" in line else line


@dataclass
class LogStream:
    """Complete lines of the followed ranks, each handed to `sink(rank, line)` (the CLI prints them, or gathers
    them for --json).

    Memory per rank is bounded: an unfinished line keeps at most LINE_MAX characters (the rest is cut with a
    marker) and a progress bar only its latest \\r state, which is shown once per poll when it changed."""

    ranks: dict[int, str]                    # rank -> node name
    sink: Callable[[int, str], None]
    offsets: dict[int, int] = field(default_factory=dict)
    partial: dict[int, str] = field(default_factory=dict)
    cutting: set = field(default_factory=set)          # ranks inside an over-long line, until its newline
    shown_progress: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.offsets = {rank: self.offsets.get(rank, 0) for rank in self.ranks}

    def feed(self, states: dict[str, NodeResult]) -> None:
        for result in states.values():
            logs = result.value.logs if result.ok else {}
            for rank_text, entry in logs.items():
                rank = int(rank_text) if rank_text.isdigit() else None
                if rank not in self.offsets:
                    continue  # not a rank this stream follows
                if entry.start is not None and entry.start != self.offsets[rank]:
                    continue  # an answer to an older request: its text was already shown
                self.offsets[rank] = entry.offset
                self.take(rank, entry.text)

    def take(self, rank: int, text: str) -> None:
        *lines, rest = (self.partial.pop(rank, "") + text).split("\n")
        for line in lines:
            if rank in self.cutting:
                self.cutting.discard(rank)
                continue
            state = latest_state(line)
            if state != self.shown_progress.pop(rank, None) or "\r" not in line:
                self.emit(rank, state)
        if rank in self.cutting:
            return
        rest = latest_state(rest) if "\r" in rest else rest
        if len(rest) > LINE_MAX:
            self.emit(rank, rest[:LINE_MAX] + f" [line cut by nodectl after {LINE_MAX} characters]")
            self.cutting.add(rank)
        elif rest:
            self.partial[rank] = rest
            if "\r" in text and rest != self.shown_progress.get(rank):
                self.shown_progress[rank] = rest
                self.emit(rank, rest)

    def flush(self) -> None:
        for rank, rest in sorted(self.partial.items()):
            if rest != self.shown_progress.get(rank):
                self.emit(rank, rest)
        self.partial.clear()

    def emit(self, rank: int, line: str) -> None:
        self.sink(rank, line)


def wait_for_end(cluster: Cluster, run_nodes: list[RunNode], stream: LogStream | None, *, interval: float = 1.0,
                 lost_after: float = 60.0, stall_after: float | None = None,
                 on_stall: Callable[[Failure], bool] | None = None, pace: PaceWatch | None = None,
                 on_pace: Callable[[list, PaceWatch], Straggler | None] | None = None,
                 on_answers: Callable[[dict[str, NodeResult]], None] | None = None,
                 on_health: Callable[[str, Health], None] | None = None) -> tuple[RunState, Failure | None]:
    """Watch until the run succeeds (SUCCEEDED) or something fails (FAILED with the failure that caused it).

    Every node streams its state (nodectl/remote/poller.py) and decisions use each node's latest answer, so a
    slow node never delays what the others report. A node is lost only as nodectl/remote/liveness.py judges it
    (certain evidence, or a silence far past its own history and `lost_after`); a slow one is told to
    `on_health` with its lag, and so is its recovery. A rank failure seen while a node is in doubt (silent past
    its usual, or its stream broken) waits until that node is judged: a lost node is the cause, the survivors'
    failures its evidence. A stall is told to `on_stall` first (once per stalled rank and step), which says whether
    it ends the watch (True) or the run is kept. With `pace`, each of its judgements (nodectl/pace.py) is told to
    `on_pace` with what changed; a straggler it gives back ends the watch as the failure (--on-straggler
    exclude). `on_answers` sees each node's fresh answers (the uploader's state rides on them)."""
    offsets = (lambda: dict(stream.offsets)) if stream else dict
    stalls = StallWatch(stall_after)
    asks = (lambda rn: pace.request(rn.node.name, list(rn.ranks))) if pace else None
    shown: dict[str, Liveness] = {}
    held = None   # since when a rank failure waits for a node in doubt
    with Poller(cluster, run_nodes, offsets, interval, lost_after=lost_after, pace=asks) as poller:
        while True:
            # a tick, or sooner where a node told of a rank's or its launcher's end; while a rank failure waits
            # for the other nodes' word, each of their lines
            hearing = held is not None and time.monotonic() - held < HEARD_HOLD * interval
            poller.news.wait(min(interval, HEARD_EVERY) if hearing else interval)
            poller.news.clear()
            drained = poller.drain()
            for answer in drained:   # in order: each line's log text once
                one = {answer.result.node.name: answer.result}
                if stream:
                    stream.feed(one)
                if on_answers:
                    on_answers(one)
                if pace:
                    _feed_pace(pace, answer)
            answers = poller.answers()
            healths = poller.healths()
            health = {rn.node.name: healths[rn.node.name] for rn in run_nodes}
            for name, said in health.items():
                if on_health and said.state != Liveness.LOST and said.state != shown.get(name, Liveness.UP):
                    on_health(name, said)
                shown[name] = said.state
            if on_health and hasattr(on_health, "flush"):   # a notice that gathers a tick's changes into one
                on_health.flush()
            latest = {name: a.result for name, a in answers.items()}
            outcome = _judge(latest, len(run_nodes))
            if isinstance(outcome, Failure) and outcome.kind in (FailureKind.RANK, FailureKind.LAUNCHER):
                held = held or time.monotonic()
                outcome = _cause(outcome, latest, health, time.monotonic() - held < IN_DOUBT_HOLD * lost_after)
                if isinstance(outcome, Failure) and outcome.kind in (FailureKind.RANK, FailureKind.LAUNCHER) \
                        and time.monotonic() - held < HEARD_HOLD * interval \
                        and any(rn.node.name != outcome.node and (rn.node.name not in answers
                                                                  or answers[rn.node.name].at < held)
                                for rn in run_nodes):
                    outcome = None   # each other node speaks after it first: one that died with it is in doubt then
            if outcome is None or isinstance(outcome, Failure) and outcome.kind in (FailureKind.RANK,
                                                                                     FailureKind.LAUNCHER):
                outcome = _broken_part(cluster, run_nodes, latest, outcome)
            if pace and outcome is None:
                outcome = _pace(pace, on_pace)
            if outcome is None:
                stall = stalls.check(latest)
                if stall and (on_stall is None or on_stall(stall)):
                    outcome = stall
            if outcome is None:
                outcome = _lost_node(run_nodes, health)
            if outcome:
                lost = isinstance(outcome, Failure) and outcome.kind == FailureKind.LOST
                if stream and not lost:   # what the followed ranks wrote after the answers that decided it
                    followed = [rn for rn in run_nodes if set(rn.ranks) & set(stream.offsets)]
                    stream.feed({name: r for name, r in poll(cluster, followed, offsets()).items() if r.ok})
                return (RunState.FAILED, outcome) if isinstance(outcome, Failure) else (RunState.SUCCEEDED, None)


def _broken_part(cluster: Cluster, run_nodes: list[RunNode], latest: dict[str, NodeResult],
                 failure: Failure | None) -> Failure | None:
    """A part of the run that cannot go on (runctl/hardware.py) is the cause: of a rank's failure too, which is
    what the part did to it. A rank failure is set against a fresh look at its node's parts first (a stream
    reads them every few seconds; the rank may have died of it in between)."""
    broken = hardware.fatal(latest)
    if broken is None and failure is not None:
        failing = [rn for rn in run_nodes if rn.node.name == failure.node]
        broken = hardware.fatal({name: r for name, r in poll(cluster, failing, hardware=True).items() if r.ok})
    if broken is None:
        return failure
    name, event = broken
    evidence = f"after it, {failure.describe()}: what the part did to it, not the cause" if failure else ""
    return Failure(kind=FailureKind.HARDWARE, node=name, detail=hardware.describe(name, event), evidence=evidence,
                   time=event.time or time.time())


def _feed_pace(pace: PaceWatch, answer) -> None:
    """One line fed to the pace watch, with the controller's times as the epoch (`sent` bounds the node's clock
    where the line said which request it had read)."""
    result = answer.result
    if result.ok and result.value:
        wall = time.time() - time.monotonic()
        pace.feed(result.node.name, result.value, answer.at + wall,
                  answer.sent + wall if answer.sent is not None else None)


IN_DOUBT_HOLD = 2.0   # a rank failure waits while a node is in doubt, at most this many times lost_after
# A rank failure is told at once (its node's watcher sends a line when a rank ends), and judged once every other
# node has sent a line since, at most this many intervals: a node that died with the rank (whose loss is the
# cause) has then had the time a tick gave it to be in doubt, and a single-node run's crash is judged at once.
HEARD_HOLD = 1.5
HEARD_EVERY = 0.1     # seconds between two looks meanwhile


def _cause(failure: Failure, latest: dict[str, NodeResult], health: dict[str, Health], wait: bool) -> Failure | None:
    """The cause of a rank failure: a node lost meanwhile (the survivors' failures are what its loss did to
    them: evidence, not the cause), None while a node is in doubt and `wait` (its verdict comes within
    lost_after), else the failure itself."""
    lost = [name for name, h in health.items() if h.state == Liveness.LOST]
    if lost:
        name = min(lost, key=lambda n: (not health[n].certain, -health[n].silent))
        return _lost_failure(name, health[name], rank_failures(latest))
    if wait and any(h.state == Liveness.SLOW for h in health.values()):
        return None
    return failure


def _lost_failure(name: str, health: Health, survivors: list[Failure]) -> Failure:
    evidence = ""
    others = [f for f in survivors if f.node != name]
    if others:
        ranks = ", ".join(f"rank {f.rank} on {f.node}" for f in others[:4]) + (" ..." if len(others) > 4 else "")
        evidence = f"after it, {ranks} failed: what its loss did to them, not the cause"
    basis = "certain" if health.certain else "silence"
    return Failure(kind=FailureKind.LOST, node=name, detail=f"{health.detail} [{basis}]", evidence=evidence,
                   time=time.time() - health.silent)


def _pace(pace: PaceWatch, on_pace) -> Failure | None:
    """The pace watch's changes told; a straggler the caller acts on, as a failure."""
    changes = pace.judge()
    acted = on_pace(changes, pace) if on_pace and pace.judged else None
    if acted is not None:
        return Failure(kind=FailureKind.STRAGGLER, node=acted.node, rank=acted.rank, detail=acted.describe(),
                       time=time.time())
    return None


def _judge(states: dict[str, NodeResult], nodes: int) -> Failure | str | None:
    """The first failure in the latest answers, "succeeded" when every node says so, else None."""
    failures = rank_failures(states)
    if failures:
        return failures[0]
    vanished = _vanished(states)
    if vanished:
        return vanished
    return "succeeded" if len(states) == nodes and finished_ok(states) else None


def _lost_node(run_nodes: list[RunNode], health: dict[str, Health]) -> Failure | None:
    """The lost node, certain evidence first (when two go quiet, the one whose port refuses is the cause)."""
    lost = [rn.node.name for rn in run_nodes if health[rn.node.name].state == Liveness.LOST]
    if not lost:
        return None
    name = min(lost, key=lambda n: (not health[n].certain, -health[n].silent))
    return _lost_failure(name, health[name], [])


@dataclass
class StallWatch:
    """A live rank stalls when its heartbeat is older than `stall_after`; a rank that writes none (a script not
    written for nodectl) when its log has not grown for that long after its first line.

    Each stall (rank and step, or log size) is told once, and one hang once for the whole run, not once per rank:
    the ranks of a hung job fall silent one after the other, and each would otherwise start its own diagnosis of
    the same hang. Another rank's stall is told only once some rank has moved on (a new step, a longer log) since
    the last one told."""

    stall_after: float | None
    grew: dict[int, tuple[int, float]] = field(default_factory=dict)   # rank -> (log size, when it last changed)
    told: set = field(default_factory=set)      # (rank, step or log size) of each stall told
    still: frozenset = frozenset()   # every live rank's (rank, step or log size) when the last stall was told

    def check(self, states: dict[str, NodeResult]) -> Failure | None:
        if not self.stall_after:
            return None
        now = time.monotonic()
        where, found = set(), None
        for name, result in states.items():
            for rank in (result.value.ranks if result.ok else ()):
                if not rank.alive:
                    continue
                size, since = self.grew.get(rank.rank, (None, now))
                if size != rank.log_size:
                    self.grew[rank.rank] = (rank.log_size, now)
                    since = now
                key = (rank.rank, rank.step if rank.heartbeat_age is not None else rank.log_size)
                where.add(key)
                if rank.heartbeat_age is not None:
                    age, why = rank.heartbeat_age, f"no heartbeat for {rank.heartbeat_age:.0f}s (last step {rank.step})"
                elif not rank.log_size:
                    continue   # no line yet: still starting (imports, model loading), never a stall
                else:
                    age = now - since
                    why = f"no heartbeat (the script writes none) and no output for {age:.0f}s"
                if age > self.stall_after and key not in self.told and found is None:
                    found = key, Failure(kind=FailureKind.STALLED, node=name, rank=rank.rank, detail=why,
                                         time=time.time())
        if found is None or self.still and where <= self.still:
            return None
        self.told.add(found[0])
        self.still = frozenset(where)
        return found[1]


def _vanished(states) -> Failure | None:
    """A node whose processes are all gone without torchrun recording an exit (killed from outside)."""
    for name, result in states.items():
        answer = result.value if result.ok else None
        if answer and answer.started and answer.alive == 0 and not answer.launcher_exit:
            return Failure(kind=FailureKind.LAUNCHER, node=name, time=time.time(),
                           detail="its processes are gone and torchrun recorded no exit code (killed from outside?)")
    return None
