"""Watching every node of a run at once: one stream per node, read by one thread each.

At the start each node runs one long-lived watcher of the run (runctl watch) over the connection the launch
already holds; it writes the run's state there as a line every interval, and the controller only reads. So a poll
costs the node nothing new to start (two interpreters a poll before, which on a node busy starting eight ranks
took up to 15 s), and 256 nodes cost the controller 256 readers, not 256 process launches an interval.

A stream that breaks is started again with back-off, from the offsets and pace marks the controller holds; how the
reconnect fails is evidence (a refused or reset connection is certain). How each node's lines usually arrive
judges it up, slow or lost (nodectl/remote/liveness.py); while it is silent past its usual, its SSH port is
knocked on (a TCP connection the kernel answers) to tell a busy host from a dead one.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable

from nodectl.remote.client import NodeClient
from nodectl.remote.liveness import Arrivals, Health, Liveness, judge, judge_all
from nodectl.runs import RunNode
from nodectl.transport import Knock, NodeErrorKind, NodeResult, failure_of
from nodectl.transport.fanout import Cluster

BACK_OFF = (0.5, 1.0, 2.0, 4.0, 8.0)   # seconds before each reconnect (the last repeats)
TICK = 10.0        # seconds between the controller's request lines (its clock, for the node's offset)
ORPHAN = 120       # seconds without a request line after which a node's watcher ends itself (cut off from us)
KNOCK_EVERY = 5.0  # seconds between knocks on a silent node's SSH port
KNOCK_TIMEOUT = 3.0
REFUSALS = 2      # refused reconnects in a row that make a node certainly gone (one may be sshd's MaxStartups)
QUEUED = 600       # answers kept per node between two reads of the watch (10 minutes at one a second)


@dataclass(frozen=True, kw_only=True)
class Answer:
    """One node's latest word: a state line (or why there is none), when it arrived and, where the node said which
    request it had read, when that request was sent (both controller monotonic seconds)."""

    result: NodeResult
    at: float
    seq: int
    sent: float | None = None


class Poller:
    def __init__(self, cluster: Cluster, run_nodes: list[RunNode], offsets: Callable[[], dict[int, int]],
                 interval: float, lost_after: float,
                 pace: Callable[[RunNode], tuple[dict, bool] | None] | None = None) -> None:
        """`offsets()`: where the controller's log stream stands ({rank: offset}); `pace(run_node)`: what to ask
        that node of its ranks' pace ({rank: since}, GPU detail or not), or None (nodectl/pace.py)."""
        self.cluster, self.run_nodes, self.offsets, self.pace = cluster, run_nodes, offsets, pace
        self.interval, self.lost_after = interval, lost_after
        self.started = time.monotonic()
        self._arrivals = {rn.node.name: Arrivals(began=self.started, interval=interval) for rn in run_nodes}
        self._answers: dict[str, Answer] = {}
        self._fresh: dict[str, deque] = {rn.node.name: deque(maxlen=QUEUED) for rn in run_nodes}
        self._seqs = dict.fromkeys(self._arrivals, 0)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.news = threading.Event()   # set when a node's line tells of an end not told before (a rank's, the
        self._ended = dict.fromkeys(self._arrivals, frozenset())   # launcher's): the watch looks at once
        self._threads = [threading.Thread(target=self._follow, args=(rn,), daemon=True, name=f"watch-{rn.node.name}")
                         for rn in run_nodes]

    def __enter__(self) -> "Poller":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()   # each thread closes its stream within a read's time-out; nobody waits for it

    # --- what the watch reads --------------------------------------------------------------------------------------

    def answers(self) -> dict[str, Answer]:
        """Each node's latest answer."""
        with self._lock:
            return dict(self._answers)

    def drain(self) -> list[Answer]:
        """Every answer that came since the last call, in order per node: each line's log text once."""
        with self._lock:
            fresh = [answer for queue in self._fresh.values() for answer in queue]
            for queue in self._fresh.values():
                queue.clear()
        return fresh

    def health(self, name: str, now: float | None = None) -> Health:
        with self._lock:
            return judge(self._arrivals[name], time.monotonic() if now is None else now, self.lost_after)

    def healths(self, now: float | None = None) -> dict[str, Health]:
        """Every node's liveness, judged with the others in view (liveness.judge_all)."""
        with self._lock:
            return judge_all(dict(self._arrivals), time.monotonic() if now is None else now, self.lost_after)

    # --- one node's thread --------------------------------------------------------------------------------------

    def _follow(self, run_node: RunNode) -> None:
        tries = 0
        transport = self.cluster.transport(run_node.node)
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                with NodeClient(transport).watch(run_node.run_dir, self._request(run_node)) as stream:
                    self._read(run_node, stream)
            except Exception as exc:  # noqa: BLE001 - unreachable, broken, or an answer with an error
                self._broke(run_node, exc)
            if self._stop.is_set():
                return
            tries = 0 if time.monotonic() - began > 30 else tries + 1   # a stream that lived resets the back-off
            self._stop.wait(BACK_OFF[min(tries, len(BACK_OFF)) - 1] if tries else BACK_OFF[0])

    def _request(self, run_node: RunNode) -> dict:
        """What a (re)started watcher reads from: the controller's offsets and pace marks, its interval, and how
        long it may go without a request line before it takes itself for orphaned and ends."""
        wanted = {str(r): o for r, o in self.offsets().items() if r in run_node.ranks}
        request = {"offsets": wanted, "interval": self.interval, "sent": time.monotonic(), "orphan_after": ORPHAN,
                   "hardware": True}
        pace = self.pace(run_node) if self.pace else None
        if pace:
            request.update(pace=pace[0], gpu_detail=bool(pace[1]))
        return request

    def _read(self, run_node: RunNode, stream) -> None:
        """Lines until the stream ends (EOFError) or the watch does; a request line when the pace's wish changes
        and every TICK seconds (the node's clock bound, and its sign that the controller is there); knocks while
        the node is silent."""
        name, detail, told, knocked = run_node.node.name, None, time.monotonic(), 0.0
        while not self._stop.is_set():
            answer = stream.next(timeout=min(0.5, self.interval))
            now = time.monotonic()
            if answer is not None:
                self._keep(name, NodeResult(run_node.node, value=answer), now, sent=answer.asked, arrived=True)
                ended = frozenset([*(r.rank for r in answer.ranks if r.exit is not None),
                                   *(["launcher"] if answer.launcher_exit is not None else [])])
                if ended - self._ended[name]:
                    self.news.set()
                self._ended[name] = ended
            pace = self.pace(run_node) if self.pace else None
            if pace is not None and bool(pace[1]) != detail or now - told >= TICK:
                detail, told = bool(pace and pace[1]), now
                stream.ask({"sent": now, **({"gpu_detail": detail} if pace is not None else {})})
            if answer is None and now - knocked >= KNOCK_EVERY and self.health(name, now).state != Liveness.UP:
                knocked = now
                self._knocked(run_node, now)

    def _knocked(self, run_node: RunNode, now: float) -> None:
        transport = self.cluster.transport(run_node.node)
        found = transport.knock(KNOCK_TIMEOUT)
        with self._lock:
            arrivals = self._arrivals[run_node.node.name]
            if arrivals.last is not None and arrivals.last > now:
                return   # it spoke meanwhile
            arrivals.knock = found
            arrivals.refusals = arrivals.refusals + 1 if found == Knock.REFUSED else 0
            if arrivals.refusals >= REFUSALS:
                arrivals.refused = (f"silent for {time.monotonic() - (arrivals.last or arrivals.began):.0f}s and "
                                    f"its SSH port refuses connections (sshd is gone: the node is down, rebooting "
                                    f"or lost its sshd)")

    def _broke(self, run_node: RunNode, exc: BaseException) -> None:
        """The stream could not start or broke: its reason kept as the node's latest answer (an error the node
        answered with is news like any line), and whether the node is certainly gone: a reconnect refused
        REFUSALS times in a row, or its port refusing a knock."""
        failure = failure_of(exc)
        if failure.kind in (NodeErrorKind.INTERNAL, NodeErrorKind.TIMEOUT) or isinstance(exc, (EOFError, OSError)):
            failure = replace(failure, kind=NodeErrorKind.UNREACHABLE, message=f"{run_node.node.name}: its watch "
                              f"stream broke ({type(exc).__name__}: {exc})")
        answered = failure.kind != NodeErrorKind.UNREACHABLE
        now = time.monotonic()
        self._keep(run_node.node.name, NodeResult(run_node.node, failure=failure), now, arrived=answered)
        if answered:
            return
        if not failure.refused:
            self._knocked(run_node, now)
        with self._lock:
            arrivals = self._arrivals[run_node.node.name]
            arrivals.broken = failure.message.split(": ", 1)[-1]
            arrivals.refusals = arrivals.refusals + 1 if failure.refused else 0
            if arrivals.refusals >= REFUSALS:
                arrivals.refused = (f"its watch stream broke and its SSH port then refused the connection (sshd "
                                    f"is gone: the node is down, rebooting or lost its sshd): {failure.message}")

    def _keep(self, name: str, result: NodeResult, at: float, *, arrived: bool, sent: float | None = None) -> None:
        with self._lock:
            self._seqs[name] += 1
            answer = Answer(result=result, at=at, seq=self._seqs[name], sent=sent)
            self._answers[name] = answer
            self._fresh[name].append(answer)
            if arrived:
                self._arrivals[name].arrived(at)
