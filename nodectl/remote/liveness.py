"""Whether a node is up, slow or lost, judged from how its own watch stream usually arrives.

Each node's watcher sends a line every interval (nodectl/remote/poller.py). A node that is busy (eight ranks
importing torch, a loaded controller, a slow path) sends late, and late is not dead: the gap now is judged
against that node's own inter-arrival history, as an accrual failure detector does (Hayashibara et al.'s phi,
as Cassandra and Akka use it). A node is `slow` when the silence is unlikely for it (phi), shown with its lag;
it is `lost` only on certain evidence (its SSH port refused or reset the connection when the stream broke) or
after a silence far past its own history and past `lost_after`, with its SSH port silent too (a host whose
kernel still answers is given twice as long: its commands may hang, which is then said).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from nodectl.transport import Knock

SLOW_PHI = 3.0       # a silence this unlikely for the node (1 in 1,000) makes it slow...
SLOW_MIN = 5.0       # ...once it is this long too: a hiccup of a few seconds is not worth a line
HISTORY = 200        # inter-arrival gaps kept per node
PAST_LONGEST = 3.0   # a lost node's silence is at least this many times its longest gap so far
CROWD_SHARE = 0.25   # silent together with this share of the other nodes (and at least CROWD_MIN): not its fault
CROWD_MIN = 2


class Liveness(str, Enum):
    UP = "up"
    SLOW = "slow"
    LOST = "lost"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, kw_only=True)
class Health:
    """A node's liveness now, and what it rests on."""

    state: Liveness
    silent: float          # seconds since its last line (since the watch began, before the first)
    usual: float           # its mean gap between lines
    detail: str = ""       # for slow and lost: the figures and the evidence
    certain: bool = False  # lost on evidence, not on silence alone


@dataclass(kw_only=True)
class Arrivals:
    """When one node's lines arrived (controller monotonic seconds), and what its connection last showed."""

    began: float
    interval: float
    last: float | None = None
    gaps: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    refused: str = ""      # the stream broke and the node's SSH port then refused or reset: why, in words
    refusals: int = 0      # refused connections in a row since its last line
    knock: Knock = Knock.UNKNOWN
    broken: str = ""       # the stream is down (reconnecting): why

    total: float = 0.0     # the sum of `gaps` and of their squares, kept as they come and go: the judge asks
    squares: float = 0.0   # several times a second per node, and statistics.pstdev took 0.4 ms a call

    def arrived(self, at: float) -> None:
        if self.last is not None:
            gap = max(0.0, at - self.last)
            if len(self.gaps) == self.gaps.maxlen:
                old = self.gaps[0]
                self.total, self.squares = self.total - old, self.squares - old * old
            self.gaps.append(gap)
            self.total, self.squares = self.total + gap, self.squares + gap * gap
        self.last = at
        self.refused, self.broken, self.knock, self.refusals = "", "", Knock.UNKNOWN, 0

    def usual(self) -> tuple[float, float]:
        """The mean and standard deviation of the node's gaps (the interval while it has none yet), the deviation
        floored at a quarter of the mean: a node that was always exactly on time is not lost at its first hiccup."""
        count = len(self.gaps)
        if count < 2:
            return self.interval, self.interval / 2
        mean = self.total / count
        deviation = math.sqrt(max(0.0, self.squares / count - mean * mean))
        return mean, max(deviation, mean / 4, 0.05)

    def phi(self, now: float) -> float:
        """-log10 of the chance that a line of this node's comes later than now, under a normal law of its gaps."""
        mean, deviation = self.usual()
        silent = now - (self.last if self.last is not None else self.began)
        tail = 0.5 * math.erfc((silent - mean) / (deviation * math.sqrt(2)))
        return -math.log10(tail) if tail > 1e-300 else 300.0

    def longest(self) -> float:
        return max(self.gaps, default=self.interval)


def judge(arrivals: Arrivals, now: float, lost_after: float, crowd: int = 0) -> Health:
    """The node's liveness now: lost on certain evidence, or on a silence past `lost_after` and past PAST_LONGEST
    times its longest gap with its SSH port knocked and silent; twice that silence where nothing says the node is
    down (its port answers, cannot be asked through a proxy, or `crowd` other nodes fell silent at the same time:
    the controller or its network is then the likelier cause); slow on an unlikely silence; up otherwise."""
    silent = now - (arrivals.last if arrivals.last is not None else arrivals.began)
    usual = arrivals.usual()[0]
    if arrivals.refused:
        return Health(state=Liveness.LOST, silent=silent, usual=usual, certain=True, detail=arrivals.refused)
    longest = arrivals.longest()
    needed = max(lost_after, PAST_LONGEST * longest)
    quiet = f"no word for {silent:.0f}s (it usually sends every {usual:.1f}s, its longest silence so far {longest:.0f}s)"
    if silent >= needed and arrivals.knock == Knock.SILENT and not crowd:
        return Health(state=Liveness.LOST, silent=silent, usual=usual,
                      detail=f"{quiet}; its SSH port does not answer either")
    if silent >= 2 * needed:
        why = {Knock.OPEN: ", though its SSH port answers (its commands hang: a stuck file system or login shell?)",
               Knock.UNKNOWN: "; its SSH port cannot be asked (reached through a proxy)",
               Knock.SILENT: "; its SSH port does not answer either"}.get(arrivals.knock, "")
        if crowd:
            why += f"; {crowd} other node(s) fell silent at the same time"
        return Health(state=Liveness.LOST, silent=silent, usual=usual, detail=f"{quiet}{why}")
    if arrivals.broken or arrivals.phi(now) >= SLOW_PHI and silent >= max(SLOW_MIN, 2 * arrivals.interval):
        why = f"; its stream broke ({arrivals.broken}), reconnecting" if arrivals.broken else ""
        return Health(state=Liveness.SLOW, silent=silent, usual=usual,
                      detail=f"{silent:.0f}s behind (it usually sends every {usual:.1f}s){why}")
    return Health(state=Liveness.UP, silent=silent, usual=usual)


def judge_all(arrivals: dict[str, Arrivals], now: float, lost_after: float) -> dict[str, Health]:
    """Every node's liveness, each judged with the others in view: a node that falls silent while a crowd of others
    (CROWD_SHARE of them, at least CROWD_MIN) is silent past its usual too waits twice as long before it is lost on
    silence alone. At 64 loaded loopback nodes one proxied node was called lost at 72 s of silence while several
    others were as quiet: the controller itself was starved (bench/watch/watch.py, 2026-11-29)."""
    plain = {name: judge(a, now, lost_after) for name, a in arrivals.items()}
    quiet = {name for name, h in plain.items() if h.state != Liveness.UP and not h.certain}
    healths = {}
    for name, health in plain.items():
        others = len(quiet - {name})
        crowded = others >= max(CROWD_MIN, CROWD_SHARE * (len(arrivals) - 1))
        healths[name] = judge(arrivals[name], now, lost_after, others) if crowded and name in quiet else health
    return healths
