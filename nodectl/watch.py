"""Watching a run: polling every node over its open connection, streaming logs, fail-fast, stop."""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field

from rich.markup import escape

from nodectl import agent
from nodectl.runs import RunNode
from nodectl.transport import Cluster, NodeResult

COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "bright_red", "bright_cyan", "bright_magenta")


@dataclass
class Failure:
    kind: str                # rank | launcher | lost | stalled
    node: str
    rank: int | None = None
    code: int | None = None
    time: float = 0.0
    detail: str = ""
    last_lines: str = ""

    def describe(self) -> str:
        if self.kind == "rank":
            how = f"exit code {self.code}" if self.code is not None and self.code >= 0 else \
                f"killed by {_signal_name(-self.code)}" if self.code is not None else "failed"
            return f"rank {self.rank} on node {self.node} failed ({how})"
        if self.kind == "lost":
            return f"node {self.node} was lost: {self.detail}"
        if self.kind == "stalled":
            return f"rank {self.rank} on node {self.node} stalled: {self.detail}"
        if self.code is None:
            return f"node {self.node}: {self.detail}"
        return f"node {self.node}: torchrun exited {self.code} {self.detail}".rstrip()


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def poll(cluster: Cluster, run_nodes: list[RunNode], offsets: dict[int, int] | None = None) -> dict[str, NodeResult]:
    by_name = {rn.node.name: rn for rn in run_nodes}

    def work(transport):
        rn = by_name[transport.node.name]
        wanted = {str(r): o for r, o in (offsets or {}).items() if r in rn.ranks}
        return agent.call(transport, "poll", rn.run_dir, request={"offsets": wanted}, timeout=30)

    return {r.node.name: r for r in cluster.fan_out(_guard(work), [rn.node for rn in run_nodes])}


def _guard(work):
    def wrapper(transport):
        try:
            return work(transport)
        except agent.AgentError as exc:
            return {"error": str(exc)}
    return wrapper


def stop_nodes(cluster: Cluster, run_nodes: list[RunNode], grace: float) -> dict[str, NodeResult]:
    by_name = {rn.node.name: rn for rn in run_nodes}

    def work(transport):
        rn = by_name[transport.node.name]
        return agent.call(transport, "stop", rn.run_dir, request={"grace": grace}, timeout=grace + 30)

    return {r.node.name: r for r in cluster.fan_out(_guard(work), [rn.node for rn in run_nodes])}


def tail_lines(cluster: Cluster, run_node: RunNode, ranks: list[int], lines: int) -> dict[int, dict]:
    result = cluster.fan_out(_guard(lambda t: agent.call(t, "tail", run_node.run_dir,
                                                         request={"ranks": ranks, "lines": lines})),
                             [run_node.node])[0]
    if not result.ok or "logs" not in (result.value or {}):
        return {}
    return {int(rank): entry for rank, entry in result.value["logs"].items()}


def rank_failures(states: dict[str, NodeResult], restarts: int = 0) -> list[Failure]:
    """Ranks that exited non-zero, and torchruns that failed without any rank failing, oldest first. With
    torchrun restarts allowed, a failed rank is torchrun's to restart: only a torchrun that gave up counts
    (reported with the rank that failed last on that node)."""
    failures = []
    for name, result in states.items():
        answer = result.value if result.ok else None
        if not answer or "error" in answer:
            continue
        failed_ranks = [Failure("rank", name, rank["rank"], rank["exit"]["code"], rank["exit"].get("time", 0))
                        for rank in answer["ranks"] if rank.get("exit") and rank["exit"].get("code") not in (0, None)]
        launcher = answer.get("launcher_exit")
        launcher_failed = launcher and launcher.get("code") not in (0, None)
        if restarts and failed_ranks:
            failures += [max(failed_ranks, key=lambda f: f.time)] if launcher_failed else []
        elif failed_ranks:
            failures += failed_ranks
        elif launcher_failed:
            failures.append(Failure("launcher", name, None, launcher["code"], launcher.get("time", 0),
                                    "(see logs/launcher.log on the node)"))
    return sorted(failures, key=lambda f: (f.time, f.rank if f.rank is not None else 1 << 30))


def derive_state(states: dict[str, NodeResult]) -> str | None:
    """What a run is, from every node's answer: running, succeeded, failed, stopped, or lost (its processes
    are gone and no torchrun recorded an exit: a reboot, or killed from outside). None if a node did not answer."""
    answers = [r.value for r in states.values() if r.ok and r.value and "error" not in r.value]
    if len(answers) < len(states) or not answers:
        return None
    if any(a.get("alive") for a in answers):
        return "running"
    exits = [a.get("launcher_exit") for a in answers]
    if all(e and e.get("code") == 0 for e in exits):
        return "succeeded"
    if any(a.get("stopped") for a in answers):
        return "stopped"
    if any(e and e.get("code") not in (0, None) for e in exits):
        return "failed"
    return "lost"


def finished_ok(states: dict[str, NodeResult]) -> bool:
    answers = [r.value for r in states.values() if r.ok and r.value and "error" not in r.value]
    return len(answers) == len(states) and all((a.get("launcher_exit") or {}).get("code") == 0 for a in answers)


@dataclass
class LogStream:
    """Complete lines of the followed ranks, prefixed and coloured per rank when following several."""

    console: object
    ranks: dict[int, str]                    # rank -> node name
    prefixed: bool
    offsets: dict[int, int] = field(default_factory=dict)
    partial: dict[int, str] = field(default_factory=dict)
    sink: object = None                      # callable(rank, line) instead of printing (--json)

    def __post_init__(self) -> None:
        self.offsets = {rank: self.offsets.get(rank, 0) for rank in self.ranks}

    def feed(self, states: dict[str, NodeResult]) -> None:
        for result in states.values():
            logs = (result.value or {}).get("logs", {}) if result.ok else {}
            for rank_text, entry in logs.items():
                rank = int(rank_text)
                self.offsets[rank] = entry["offset"]
                text = self.partial.pop(rank, "") + entry["text"]
                *lines, rest = text.split("\n")
                if rest:
                    self.partial[rank] = rest
                for line in lines:
                    self.emit(rank, line)

    def flush(self) -> None:
        for rank, rest in sorted(self.partial.items()):
            self.emit(rank, rest)
        self.partial.clear()

    def emit(self, rank: int, line: str) -> None:
        if self.sink:
            self.sink(rank, line)
        elif self.prefixed:
            colour = COLOURS[rank % len(COLOURS)]
            label = escape(f"[{self.ranks[rank]}/{rank}]")
            self.console.print(f"[{colour}]{label}[/] {escape(line)}")
        else:
            self.console.print(escape(line))


def wait_for_end(cluster: Cluster, run_nodes: list[RunNode], stream: LogStream | None, *, interval: float = 1.0,
                 lost_after: float = 15.0, stall_after: float | None = None,
                 restarts: int = 0) -> tuple[str, Failure | None]:
    """Poll until the run succeeds ('succeeded') or something fails ('failed' with the first failure)."""
    unreachable_since: dict[str, float] = {}
    while True:
        started = time.monotonic()
        states = poll(cluster, run_nodes, stream.offsets if stream else None)
        if stream:
            stream.feed(states)
        failures = rank_failures(states, restarts)
        if failures:
            return "failed", failures[0]
        lost = _lost_node(states, unreachable_since, lost_after)
        if lost:
            return "failed", lost
        stalled = _stalled_rank(states, stall_after)
        if stalled:
            return "failed", stalled
        gone = _vanished(states)
        if gone:
            return "failed", gone
        if finished_ok(states):
            return "succeeded", None
        time.sleep(max(0.0, interval - (time.monotonic() - started)))


def _lost_node(states, unreachable_since: dict, lost_after: float) -> Failure | None:
    now = time.monotonic()
    for name, result in states.items():
        if result.unreachable or (result.ok and "error" in (result.value or {})):
            first = unreachable_since.setdefault(name, now)
            if now - first >= lost_after:
                detail = result.error or result.value.get("error")
                return Failure("lost", name, detail=f"unreachable for {now - first:.0f}s ({detail})", time=first)
        else:
            unreachable_since.pop(name, None)
    return None


def _stalled_rank(states, stall_after: float | None) -> Failure | None:
    if not stall_after:
        return None
    for name, result in states.items():
        for rank in ((result.value or {}).get("ranks", []) if result.ok else []):
            age = rank.get("heartbeat_age")
            if rank.get("alive") and age is not None and age > stall_after:
                step = rank.get("heartbeat", {}).get("step")
                return Failure("stalled", name, rank["rank"], detail=f"no heartbeat for {age:.0f}s (last step {step})",
                               time=time.time())
    return None


def _vanished(states) -> Failure | None:
    """A node whose processes are all gone without torchrun recording an exit (killed from outside)."""
    for name, result in states.items():
        answer = result.value if result.ok else None
        if answer and "error" not in answer and answer.get("started") and answer.get("alive") == 0 \
                and not answer.get("launcher_exit"):
            return Failure("launcher", name, detail="its processes are gone and torchrun recorded no exit code "
                                                    "(killed from outside?)",
                           time=time.time())
    return None
