"""Why a run hangs, judged across its ranks: small pure functions over what every rank's dump says.

Each check looks at the ranks' views (`RankView`: state, CPU, stacks, flight recorder) and either names a cause
or passes; `judge` asks them in order and the first that names one is the verdict:
1. desync: ranks entered the same collective (group, sequence id) with different ops, sizes or dtypes;
2. gone: a rank exited, or its node was lost, while the others live on;
3. behind: ranks wait in collective #N of a group that other ranks of that group never entered: those are named,
   with what they do instead (compute at a line, waiting at a line, another collective);
4. network: every rank of a group has been in the same collective for a while, none completing;
5. compute: no collective waits, and a rank burns CPU at one line;
6. idle: no collective waits, no rank computes, and the heartbeats are old: the ranks wait outside torch;
7. healthy: nothing waits and nothing is stuck.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from nodectl.diagnose.flight import Collective, Frame, Recorder, ThreadStack

WAITING_S = 5.0      # a collective pending longer than this is a wait, not traffic
BUSY_PERCENT = 50.0  # a rank using more of a core than this is computing


@dataclass(frozen=True)
class RankView:
    rank: int
    node: str
    running: bool
    exit_code: int | None = None
    lost: str | None = None             # why its node did not answer
    cpu: float | None = None            # % of one core
    main_state: str | None = None
    threads: tuple[ThreadStack, ...] = ()
    stack_text: str | None = None       # py-spy / faulthandler, where the rank had no listener
    recorder: Recorder = field(default_factory=Recorder)
    heartbeat_age: float | None = None
    step: object = None
    log_tail: str = ""
    now: float | None = None            # the node's clock when it answered
    listener_error: str | None = None

    @property
    def main(self) -> ThreadStack | None:
        return next((t for t in self.threads if t.main), None)

    def where(self) -> Frame | None:
        return self.main.innermost_user_frame() if self.main else None

    def waits(self) -> list[Collective]:
        """Collectives this rank has been in for WAITING_S or longer, oldest first."""
        found = [c for c in self.recorder.pending()
                 if not c.p2p and c.created is not None and self.now is not None and self.now - c.created >= WAITING_S]
        return sorted(found, key=lambda c: c.created)

    def age(self, collective: Collective) -> float:
        return max(0.0, (self.now or 0.0) - (collective.created or self.now or 0.0))

    @property
    def busy(self) -> bool:
        """Computing: most of a core, or running when sampled with a fair share of a crowded machine's."""
        return self.cpu is not None and (self.cpu >= BUSY_PERCENT or self.main_state == "R" and self.cpu >= 10.0)


@dataclass(frozen=True)
class Verdict:
    kind: str   # desync | gone | behind | teardown | compute | network | idle | waiting | healthy | ended | unknown
    summary: str
    culprits: tuple[int, ...] = ()
    evidence: tuple[str, ...] = ()
    advice: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"kind": self.kind, "summary": self.summary, "culprits": list(self.culprits),
                "evidence": list(self.evidence), "advice": list(self.advice)}


Shorten = Callable[[str], str]


def judge(views: list[RankView], shorten: Shorten = lambda path: path) -> Verdict:
    views = sorted(views, key=lambda v: v.rank)
    if not views:
        return Verdict("unknown", "no rank answered: nothing to judge")
    if not any(v.running for v in views):
        return Verdict("ended", "no rank of the run is running: it is not hung, it ended (see `nodectl status`)")
    for check in (desync, gone, behind, network, compute, idle, waiting):
        verdict = check(views, shorten)
        if verdict:
            return verdict
    return healthy(views, shorten)


def desync(views: list[RankView], shorten: Shorten) -> Verdict | None:
    """Ranks that entered one collective (group, sequence id) with different ops, sizes or dtypes: the earliest
    such collective in the recorders (a mismatch that completed, same bytes in other shapes, is why the ranks
    then went different ways)."""
    entries: dict[tuple[str, int], list[tuple[RankView, Collective]]] = {}
    for view in views:
        for c in view.recorder.collectives:
            if not c.p2p:
                entries.setdefault((c.group, c.seq), []).append((view, c))
    for (group, seq), found in sorted(entries.items(), key=lambda item: item[0][1]):
        sides: dict[tuple, list[tuple[RankView, Collective]]] = {}
        for view, c in found:
            sides.setdefault(c.signature(), []).append((view, c))
        if len(sides) < 2:
            continue
        described = []
        for members in sorted(sides.values(), key=len, reverse=True):
            first = members[0][1]
            at = first.called_at() or (members[0][0].where() if not first.done else None)
            described.append(f"{_ranks([v.rank for v, _ in members])} called {first.op} with {first.shapes()}"
                             + (f" at {at.where(shorten)}" if at else ""))
        minority = sorted(sides.values(), key=len)[0]
        return Verdict(
            "desync", f"desync in collective #{seq} (group {group}): " + "; ".join(described),
            culprits=tuple(v.rank for v, _ in minority), evidence=tuple(_evidence(views, shorten)),
            advice=("every rank must call the same collectives in the same order with the same shapes and dtypes: "
                    "look for a branch on the rank or on the data (an uneven last batch, a rank-dependent size) "
                    "before the lines named above",
                    "stop the run: `nodectl stop`"))
    return None


def gone(views: list[RankView], shorten: Shorten) -> Verdict | None:
    """A rank that exited or whose node was lost, while other ranks live (and, usually, wait for it)."""
    missing = [v for v in views if not v.running]
    if not missing:
        return None
    waiting = [v for v in views if v.running and v.waits()]
    lost_nodes = sorted({v.node for v in missing if v.lost})
    parts = []
    for node in lost_nodes:
        ranks = [v.rank for v in missing if v.node == node]
        reason = next(v.lost for v in missing if v.node == node)
        parts.append(f"node {node} was lost ({reason}); its {_ranks(ranks)} cannot answer")
    for v in missing:
        if not v.lost:
            how = f"exited with code {v.exit_code}" if v.exit_code is not None else "is not running"
            parts.append(f"rank {v.rank} on {v.node} {how}")
    summary = "; ".join(parts)
    if waiting:
        collective = waiting[0].waits()[0]
        summary += (f", while {_ranks([v.rank for v in waiting])} wait{'s' if len(waiting) == 1 else ''} in "
                    f"{collective.label()} for {waiting[0].age(collective):.0f} s")
    advice = ["the ranks left waiting will not finish: stop the run (`nodectl stop`)"]
    if lost_nodes:
        advice.append("check the lost node (`nodectl preflight`); `launch --max-restarts N --exclude-failed` goes "
                      "on without a node that fails")
    else:
        advice.append("the rank's last lines say why it exited: `nodectl tail RANK`")
    return Verdict("gone", summary, tuple(v.rank for v in missing), tuple(_evidence(views, shorten)), tuple(advice))


def behind(views: list[RankView], shorten: Shorten) -> Verdict | None:
    """Ranks that never entered a collective the others of its group wait in."""
    for group, seq in _waited_collectives(views):
        members = _members(views, group)
        waiting = [v for v in members if any(c.group == group and c.seq == seq for c in v.waits())]
        late = [v for v in members if v.recorder.present and v.recorder.last_enqueued.get(group, -1) < seq]
        if not waiting or not late:
            continue
        collective = next(c for c in waiting[0].waits() if c.group == group and c.seq == seq)
        culprit = late[0]
        doing, kind = _doing(culprit, group, shorten)
        others = f"{_ranks([v.rank for v in waiting])} {'has' if len(waiting) == 1 else 'have'} been waiting in"
        names = (f"rank {culprit.rank} on {culprit.node}" if len(late) == 1 else
                 f"{_ranks([v.rank for v in late])} (first: rank {culprit.rank} on {culprit.node})")
        if kind == "compute":
            summary = (f"{names} is stuck in compute {doing}; it never entered {collective.label()}, which {others} "
                       f"for {waiting[0].age(collective):.0f} s")
        elif kind == "teardown":
            summary = (f"{names} is tearing down its process group {doing} while {others} {collective.label()} for "
                       f"{waiting[0].age(collective):.0f} s: it left its work (an exception?) and its teardown "
                       f"waits on them; its log's last lines say why")
        else:
            summary = (f"{names} never entered {collective.label()}, which {others} for "
                       f"{waiting[0].age(collective):.0f} s; it is {doing}")
        advice = [f"look at what rank {culprit.rank} does there: it is why every other rank waits",
                  "`nodectl stacks` shows every thread of every rank; stop the run with `nodectl stop`"]
        return Verdict(kind if kind in ("compute", "teardown") else "behind", summary, tuple(v.rank for v in late),
                       tuple(_evidence(views, shorten)), tuple(advice))
    return None


def network(views: list[RankView], shorten: Shorten) -> Verdict | None:
    """Every rank of a group in the same collective, with the same shapes, for a while: nobody is missing, and
    still it does not complete."""
    for group, seq in _waited_collectives(views):
        members = _members(views, group)
        if not members or not all(any(c.group == group and c.seq == seq for c in v.waits()) for v in members):
            continue
        collective = next(c for c in members[0].waits() if c.group == group and c.seq == seq)
        age = min(v.age(next(c for c in v.waits() if c.group == group and c.seq == seq)) for v in members)
        who = f"all {len(members)} ranks of group {group} have" if len(members) > 1 else \
            f"the only rank of group {group} has"
        return Verdict(
            "network",
            f"{who} been in {collective.label()} for {age:.0f} s and none completes "
            f"({collective.backend}: {collective.state}): the network between the nodes or a GPU, not the program",
            tuple(v.rank for v in members), tuple(_evidence(views, shorten)),
            ("`nodectl preflight --full` measures every node pair and finds a slow or broken link or GPU",
             "set NCCL_DEBUG=INFO in the inventory's env: and look at the transport NCCL chose (NET/IB or "
             "NET/Socket) in the rank logs",
             "stop the run: `nodectl stop`"))
    return None


def compute(views: list[RankView], shorten: Shorten) -> Verdict | None:
    """No collective waits, and a rank burns CPU without reporting progress."""
    if any(v.waits() for v in views):
        return None
    running = [v for v in views if v.running]
    stuck = [v for v in running if v.busy and not _fresh(v)]
    if not stuck or (len(stuck) == len(running) and all(v.heartbeat_age is None for v in running)):
        return None   # every rank computes and none reports progress: work, as far as anyone can tell
    culprit = max(stuck, key=lambda v: v.cpu or 0.0)
    doing, _ = _doing(culprit, None, shorten)
    return Verdict("compute", f"rank {culprit.rank} on {culprit.node} is stuck in compute {doing}; no collective is "
                              f"pending",
                   tuple(v.rank for v in stuck), tuple(_evidence(views, shorten)),
                   (f"look at rank {culprit.rank}'s loop there: it runs but never reaches the next step",
                    "stop the run: `nodectl stop`"))


def idle(views: list[RankView], shorten: Shorten) -> Verdict | None:
    stale = [v for v in views if v.running and v.heartbeat_age is not None and not _fresh(v)]
    if any(v.waits() for v in views) or any(v.busy for v in views) or not stale:
        return None
    first = stale[0]
    doing, _ = _doing(first, None, shorten)
    return Verdict("idle", f"no collective is pending and no rank computes, and no heartbeat for "
                           f"{min(v.heartbeat_age for v in stale):.0f} s: the ranks wait outside torch.distributed; "
                           f"rank {first.rank} on {first.node} is {doing}",
                   tuple(v.rank for v in stale), tuple(_evidence(views, shorten)),
                   ("the stacks say what they wait for (a file, a lock, a subprocess, input): `nodectl stacks`",))


def waiting(views: list[RankView], shorten: Shorten) -> Verdict | None:
    """Ranks that wait in a collective while no check could name why (the others gave no flight recorder or
    stack): never "no hang found" against its own evidence."""
    found = [(v, v.waits()[0]) for v in views if v.running and v.waits()]
    if not found:
        return None
    view, collective = max(found, key=lambda pair: pair[0].age(pair[1]))
    ranks = _ranks([v.rank for v, _ in found])
    silent = [v.rank for v in views if v.running and not v.recorder.present]
    return Verdict("waiting", f"{ranks} {'has' if len(found) == 1 else 'have'} waited in {collective.label()} for "
                              f"{view.age(collective):.0f} s and no rank was seen behind, computing or gone"
                   + (f" ({_ranks(silent)} gave no flight recorder)" if silent else "")
                   + ": not proven hung, not healthy", (), tuple(_evidence(views, shorten)),
                   ("diagnose again in a minute: a wait that grows is a hang; `nodectl stacks` shows where every "
                    "rank is",))


def healthy(views: list[RankView], shorten: Shorten) -> Verdict:
    steps = sorted({str(v.step) for v in views if v.step is not None})
    return Verdict("healthy", f"no hang found: no collective has waited {WAITING_S:.0f} s or more"
                              + (f"; ranks report step {', '.join(steps)}" if steps else ""),
                   evidence=tuple(_evidence(views, shorten)))


def _fresh(view: RankView) -> bool:
    """A heartbeat recent enough that the rank is making progress (no heartbeat at all: unknown, not fresh)."""
    return view.heartbeat_age is not None and view.heartbeat_age < 2 * WAITING_S


def _waited_collectives(views: list[RankView]) -> list[tuple[str, int]]:
    """(group, seq) of the collectives ranks wait in, the longest-waited first."""
    oldest: dict[tuple[str, int], float] = {}
    for v in views:
        for c in v.waits():
            key = (c.group, c.seq)
            oldest[key] = max(oldest.get(key, 0.0), v.age(c))
    return sorted(oldest, key=lambda key: -oldest[key])


def _members(views: list[RankView], group: str) -> list[RankView]:
    """The live ranks of a process group (every rank where the recorder does not say)."""
    ranks = None
    for v in views:
        ranks = v.recorder.groups.get(group)
        if ranks:
            break
    return [v for v in views if v.running and (ranks is None or v.rank in ranks)]


# a rank in these has stopped training: it destroys (or aborts) its communicators, and under NCCL that waits for
# the peers still in a collective
TEARDOWN = ("destroy_process_group", "_abort_process_group")


def _doing(view: RankView, group: str | None, shorten: Shorten) -> tuple[str, str]:
    """What a rank does instead of joining: (words, kind) with kind compute | collective | waiting."""
    other = next((c for c in view.waits() if c.group != group), None) or \
        next((c for c in view.recorder.pending() if c.group != group and not c.p2p), None)
    frame = view.where()
    at = f"at {frame.where(shorten)}" if frame else "(no Python stack: see `nodectl stacks`)"
    source = f" (`{frame.text.strip()}`)" if frame and frame.text.strip() else ""
    cpu = f"CPU {view.cpu:.0f}%" if view.cpu is not None else "CPU unknown"
    if other is not None:
        return f"in another collective, {other.label()}, {at}", "collective"
    if view.main is not None and view.main.calls(*TEARDOWN):
        return at, "teardown"
    if view.busy:
        return f"{at}{source}, {cpu}", "compute"
    state = {"S": "sleeping", "D": "in I/O", "R": "running"}.get(view.main_state or "", "waiting")
    return f"{state} {at}{source}, {cpu}", "waiting"


def _evidence(views: list[RankView], shorten: Shorten) -> list[str]:
    """One line per rank: where it is, what it waits in, its CPU and heartbeat."""
    lines = []
    for v in views:
        if not v.running:
            state = f"lost ({v.lost})" if v.lost else f"exited ({v.exit_code})" if v.exit_code is not None \
                else "not running"
            lines.append(f"rank {v.rank} on {v.node}: {state}")
            continue
        parts = []
        pending = sorted((c for c in v.recorder.pending() if not c.p2p), key=lambda c: c.created or 0.0)
        if pending:
            parts.append(f"in {pending[0].label()} for {v.age(pending[0]):.0f} s")
        elif v.recorder.present:
            done = ", ".join(f"group {g} at #{s}" for g, s in sorted(v.recorder.last_completed.items()))
            parts.append(f"no collective pending (completed: {done or 'none'})")
        else:
            parts.append("no flight recorder" + (f" ({v.listener_error})" if v.listener_error else ""))
        frame = v.where()
        if frame:
            parts.append(f"at {frame.where(shorten)}")
        if v.cpu is not None:
            parts.append(f"CPU {v.cpu:.0f}%")
        if v.heartbeat_age is not None:
            parts.append(f"heartbeat {v.heartbeat_age:.0f} s ago (step {v.step})")
        lines.append(f"rank {v.rank} on {v.node}: " + ", ".join(parts))
    return lines


def _ranks(ranks: list[int]) -> str:
    """'rank 3', 'ranks 0-2, 4-7'."""
    ranks = sorted(set(ranks))
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    spans, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            spans.append(f"{start}-{r}" if r != start else f"{r}")
            start = None
    return "ranks " + ", ".join(spans)
