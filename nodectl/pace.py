"""A run's pace while it runs: which rank the others wait for, how much slower it is, what the run pays, and why.

Every rank's pace thread (launchers/sitecustomize.py) copies its latest collectives from torch's flight recorder:
process group, sequence id, when this rank reached it, and on NCCL (TORCH_NCCL_ENABLE_TIMING) how long it took. The
nodes' polls bring them here (runctl/pace.py) with each rank's scheduler counters. For each collective every rank
reached, the last to arrive is the one the others waited for; a rank's wait is the last arrival minus its own
(on NCCL: its collective's duration minus the shortest, which needs no clock at all). Over a window:

- a rank's *busy* time is the window minus its waits: computing, loading data, launching kernels;
- the straggler is the rank busy longest; it is *slower* by its busy time over the median rank's;
- the run's *pace* is its rate now (steps, or collectives for a script that writes no heartbeat) against its own
  healthy rate after warm-up.

A verdict is given once one rank stays at least `slower` (15%) slower than the median for `hold` seconds, and
withdrawn once it stays below half that. The node clocks are put on the controller's by each poll's own time (the
error is the poll's one-way latency, milliseconds against steps of tenths of seconds). Nothing here talks to a
node: the poller asks what `request` says and hands the answers to `feed`.
"""
from __future__ import annotations

import math
import statistics
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace

# NVML clock event reasons that mean the GPU was held back (nvmlClocksEventReasons; idle and app clocks are not)
CLOCK_REASONS = {0x4: "its power cap", 0x8: "a hardware slowdown", 0x20: "software thermal limits",
                 0x40: "thermal limits", 0x80: "the power brake"}


@dataclass(frozen=True)
class PaceSettings:
    window: float = 20.0      # seconds of collectives judged at once
    every: float = 5.0        # how often they are judged
    slower: float = 0.15      # a rank this much slower than the median rank...
    hold: float = 15.0        # ...for this long is the straggler
    warmup: float = 30.0      # seconds after the first collectives before the healthy pace is measured
    low_pace: float = 0.85    # the run-wide line: every rank slower than this fraction of the healthy pace
    look: float = 60.0        # seconds of collectives one look (`status`) judges: what the ranks' pace files hold


@dataclass
class RankTime:
    rank: int
    node: str
    busy: float               # share of the window not waiting in collectives (computing, data, launches)
    wait: float               # share of the window spent waiting in collectives for other ranks
    data: float | None = None   # share of it getting batches ready (the built-in trainer's heartbeat data_s)


@dataclass
class Straggler:
    rank: int
    node: str
    gpu: str | None
    slower: float             # its busy time over the median rank's, minus 1 (0.9 = 1.9x)
    pace: float | None        # the run's rate now against its healthy rate
    since: float              # when it was first seen slower (controller's clock)
    causes: list[str] = field(default_factory=list)
    ended: float | None = None
    # what the verdict rests on besides the timings the other ranks report of themselves (which a rank writes and
    # so could forge): `corroborated` when it holds with each other node's timings left out in turn, or when its
    # own node's counters (read by runctl, not written by any rank) show a cause; `basis` says which, or why not
    corroborated: bool = False
    basis: str = ""
    told: float | None = None  # when the verdict was told (after the hold): --straggler-hold counts from here

    def describe(self) -> str:
        where = f"rank {self.rank} on node {self.node}" + (f" (GPU {self.gpu})" if self.gpu is not None else "")
        pays = f"; pace {self.pace:.2f}x" if self.pace is not None else ""
        cause = "; " + "; ".join(self.causes) if self.causes else "; no cause seen on its node"
        doubt = f" (not certain: {self.basis})" if not self.corroborated and self.basis else ""
        return f"straggler: {where} is {self.slower * 100:.0f}% slower than the median rank{pays}{cause}{doubt}"

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class PaceState:
    """What the watch knows now: each rank's time split, the run's pace, the straggler (if any) and every
    straggler event so far."""

    ranks: list[RankTime] = field(default_factory=list)
    pace: float | None = None
    rate: float | None = None
    unit: str = "collectives/s"
    straggler: Straggler | None = None
    events: list[Straggler] = field(default_factory=list)
    run_wide: str = ""
    busbw_gbs: float | None = None      # the run's collectives' bus bandwidth over the window (NCCL-timed only)
    collective_mib: float | None = None   # their median size
    reference: dict | None = None       # preflight's all-reduce on these nodes: {busbw_gbs, mib, time}

    @property
    def split(self) -> str:
        """Where the median rank's time goes, in words (see split_line), and what the collectives move."""
        return split_line([asdict(r) for r in self.ranks], self.busbw_gbs, self.collective_mib, self.reference)

    def to_json(self) -> dict:
        return {"pace": self.pace, "rate": self.rate, "unit": self.unit,
                "ranks": [asdict(r) for r in self.ranks], "straggler": self.straggler and self.straggler.to_json(),
                "events": [e.to_json() for e in self.events], "run_wide": self.run_wide, "split": self.split,
                "busbw_gbs": self.busbw_gbs, "collective_mib": self.collective_mib, "time": time.time()}


def split_line(ranks: list, busbw: float | None = None, mib: float | None = None,
               reference: dict | None = None) -> str:
    """"where the time goes: 71% computing, 5% getting data, 24% waiting for other ranks in collectives" over the
    ranks' shares (median of each); "" without shares. Computing includes the collectives' own transfers (the
    part no rank waits for) and anything else the rank does between them."""
    waits = [_number(r.get("wait")) for r in ranks if isinstance(r, dict)]
    waits = [w for w in waits if w is not None]
    if not waits:
        return ""
    data = [_number(r.get("data")) for r in ranks if isinstance(r, dict)]
    data = [d for d in data if d is not None]
    wait = statistics.median(waits)
    fed = statistics.median(data) if len(data) == len(waits) else None
    computing = max(0.0, 1 - wait - (fed or 0.0))
    parts = [f"{computing * 100:.0f}% computing"] + ([f"{fed * 100:.0f}% getting data"] if fed is not None else []) \
        + [f"{wait * 100:.0f}% waiting for other ranks in collectives"]
    said = "where the time goes (median rank): " + ", ".join(parts)
    if busbw is not None:
        said += f"; the collectives move {busbw:.1f} GB/s (bus bandwidth, median {mib:.0f} MiB)"
        gave, at_mib = _reference_at(reference, mib)
        if gave:
            share_of = busbw / gave
            said += (f", {share_of * 100:.0f}% of the {gave:.1f} GB/s preflight's all-reduce of "
                     f"{at_mib:.0f} MiB gave on these nodes")
            if share_of >= 0.8:
                said += ": the links give no more (where collectives are on the critical path, the network is the " \
                        "limit)"
            elif share_of < 0.5:
                said += ": well under what the links gave (small or latency-bound collectives, or another path)"
    return said


def _reference_at(reference: dict | None, mib: float | None) -> tuple[float | None, float]:
    """(busbw, MiB) of preflight's all-reduce at the measured size nearest the run's median collective (in
    log scale: bandwidth grows with size), else at its largest."""
    if not reference or not reference.get("busbw_gbs"):
        return None, 0.0
    curve = reference.get("curve") or []
    if curve and mib:
        size, busbw = min(curve, key=lambda point: abs(math.log(max(point[0], 1) / (mib * (1 << 20)))))
        return busbw, size / (1 << 20)
    return reference["busbw_gbs"], reference.get("mib", 0.0)


BUS_FACTOR = {"allreduce": lambda n: 2 * (n - 1) / n, "gather": lambda n: (n - 1) / n,
              "scatter": lambda n: (n - 1) / n, "alltoall": lambda n: (n - 1) / n, "other": lambda n: 1.0}
BUS_MIN_BYTES = 1 << 20   # smaller collectives measure their latency, not the links
DATA_CAUSE = "it waits for its data"   # a cause from the ranks' own heartbeats (their word, not a node's counters)


class PaceWatch:
    """Fed each poll's answers; `judge()` every few seconds gives what changed (a new straggler, one gone, a
    run-wide slowdown) and `state` what holds now."""

    def __init__(self, rank_nodes: dict[int, str], rank_gpus: dict[int, str | None] | None = None,
                 settings: PaceSettings = PaceSettings(), gpus: bool = False) -> None:
        self.rank_nodes, self.rank_gpus = rank_nodes, rank_gpus or {}
        self.settings, self.gpus = settings, gpus
        self.state = PaceState()
        self._lock = threading.Lock()
        self._since: dict[int, int] = {}                       # rank -> latest reached ns asked from
        self._reached: dict[tuple, dict[int, float]] = defaultdict(dict)   # (group, seq) -> rank -> controller s
        self._durations: dict[tuple, dict[int, float]] = defaultdict(dict)
        self._moved: dict[tuple, tuple[int, str]] = {}              # (group, seq) -> (bytes, kind)
        self._offsets: dict[str, float] = {}                   # node/low, node/high: its clock minus ours
        self._counters: dict[int, list[tuple]] = defaultdict(list)   # rank -> [(time, cpu, runqueue, throttled)]
        self._data: dict[int, list[tuple]] = defaultdict(list)       # rank -> [(time, seconds getting data)]
        self._node_cpu: dict[str, list[tuple]] = defaultdict(list)   # node -> [(time, steal, load, cpus)]
        self._pressure: dict[str, list[tuple]] = defaultdict(list)   # node -> [(time, memory s, I/O s, swap pages)]
        self._hidden: dict[str, str | None] = {}   # node -> how its /proc hides other users' processes (hidepid=2)
        self._gpu_detail: dict[str, dict] = {}
        self._others: dict[str, list[dict]] = {}                # node -> its busiest processes not the run's
        self._steps: list[tuple[float, float]] = []            # (time, step) of the slowest rank's heartbeat
        self._first: float | None = None
        self._recent: list = []                                # the last window's complete collectives
        self._healthy: list[float] = []
        self._healthy_busbw: list[float] = []                  # the collectives' bus bandwidth while healthy
        self._candidate: tuple[int, float] | None = None       # (rank, since)
        self._calm_since: float | None = None
        self._last_judged = 0.0
        self._low_since: float | None = None
        self.judged = False                                     # the last judge() looked at a new window
        self.timed = False                                      # the last window's waits came from NCCL's timing

    # what the poller asks each node -------------------------------------------------------------------------
    def request(self, node: str, ranks: list[int]) -> tuple[dict, bool]:
        with self._lock:
            since = {str(r): self._since.get(r, 0) for r in ranks}
            candidate = self._candidate or (self.state.straggler and (self.state.straggler.rank, 0))
            slowed = self._low_since is not None or bool(self.state.run_wide)   # every rank: every node's GPUs
            detail = bool(self.gpus and (slowed or candidate and self.rank_nodes.get(candidate[0]) == node))
        return since, detail

    # what the nodes answered --------------------------------------------------------------------------------
    def feed(self, node: str, answer, received: float, sent: float | None = None) -> None:
        """One node's poll answer (nodectl.remote.answers.PollAnswer), asked at `sent` and received at `received`
        (controller clock)."""
        pace = getattr(answer, "pace", None)
        if pace is None:
            return
        with self._lock:
            shift = self._clock(node, answer.now, sent, received)
            for rank_text, rp in pace.ranks.items():
                rank = int(rank_text)
                if self.rank_nodes.get(rank) != node:
                    continue   # a node speaks for its own ranks only: another's rows would judge them
                moved = list(zip(rp.moved, rp.kinds)) if len(rp.moved) == len(rp.seqs) == len(rp.kinds) else []
                for index, (group, seq, reached, duration) in enumerate(zip(rp.groups, rp.seqs, rp.reached,
                                                                             rp.durations)):
                    if not 0 < reached < 1 << 63:
                        continue   # not a time (a row of 10^400 ns overflowed the float it becomes)
                    key = (group, seq)
                    if moved and isinstance(moved[index][0], int) and moved[index][1] in BUS_FACTOR:
                        self._moved[key] = moved[index]
                    self._reached[key][rank] = reached / 1e9 - shift
                    if duration is not None:
                        self._durations[key][rank] = duration / 1e3
                    self._since[rank] = max(self._since.get(rank, 0), reached)
                if rp.cpu_s is not None:
                    first = rp.earlier or {}
                    ago, cpu_then = _number(first.get("ago")), _number(first.get("cpu_s"))
                    if ago is not None and 0 < ago < 60 and cpu_then is not None and not self._counters[rank]:
                        self._counters[rank].append((received - ago, cpu_then, _number(first.get("runqueue_s")) or 0.0,
                                                     _number(first.get("throttled_s"))))
                    self._counters[rank].append((received, rp.cpu_s, rp.runqueue_s or 0.0, rp.throttled_s))
                    del self._counters[rank][:-120]
            if pace.cpu:
                cpu = pace.cpu
                self._node_cpu[node].append((received, cpu.get("steal_s"), cpu.get("load1"), cpu.get("cpus")))
                del self._node_cpu[node][:-120]
                self._pressure[node].append((received, _number(cpu.get("mem_some_s")), _number(cpu.get("io_some_s")),
                                             _number(cpu.get("swap_pages"))))
                del self._pressure[node][:-120]
                if "others" in cpu:
                    self._others[node] = _others_of(cpu.get("others"))
                self._hidden[node] = _printable(cpu["hidden"]) if isinstance(cpu.get("hidden"), str) else None
            if pace.gpus:
                self._gpu_detail[node] = {k: v for k, v in pace.gpus.items()}
            for rank_state in answer.ranks:
                waited = _number((rank_state.heartbeat or {}).get("data_s"))
                if waited is not None and self.rank_nodes.get(rank_state.rank) == node:
                    samples = self._data[rank_state.rank]
                    if not samples or samples[-1][1] != waited:   # a new heartbeat (each step writes one)
                        samples.append((received, waited))
                        del samples[:-400]
            steps = [r.step for r in answer.ranks if isinstance(r.step, (int, float)) and not isinstance(r.step, bool)
                     and self.rank_nodes.get(r.rank) == node]
            if steps:
                self._steps.append((received, float(min(steps))))
                del self._steps[:-2000]

    def look(self, now: float | None = None) -> PaceState:
        """What the collectives known so far say at once, without waiting for a verdict to hold (`status`): each
        rank's time split, and the slowest rank as a straggler when it is `slower` behind the median."""
        now = time.time() if now is None else now
        with self._lock:
            window = self._window(now, self.settings.look)
        if window is None:
            return self.state
        times, rate, unit = window
        state = self.state
        state.ranks, state.rate, state.unit = times, rate, unit
        busiest, slower = _slowest(times)
        if slower >= self.settings.slower and len(times) > 1:
            state.straggler = Straggler(busiest.rank, busiest.node, self.rank_gpus.get(busiest.rank),
                                        self._told(slower, None), None, now)
            with self._lock:
                state.straggler.causes = self._causes(state.straggler, now)
        return state

    def _clock(self, node: str, now: float, sent: float | None, received: float) -> float:
        """The node's clock minus the controller's, as far as it is proven: the node read `now` between `sent`
        and `received`, so the difference lies between now - received and now - sent. While that range holds 0
        (clocks kept by NTP, or one machine) nothing is corrected: guessing inside it would add the poll's
        latency as an error, tens of ms against steps that may be as short."""
        low, high = self._offsets.get(node + "/low", -1e18), self._offsets.get(node + "/high", 1e18)
        low = max(low, now - received)
        high = min(high, now - sent) if sent is not None else high
        if high < low:   # the clock stepped (NTP): start again from this poll
            low, high = now - received, (now - sent) if sent is not None else 1e18
        self._offsets[node + "/low"], self._offsets[node + "/high"] = low, high
        return low if low > 0 else high if high < 0 else 0.0

    # the verdicts -------------------------------------------------------------------------------------------
    def judge(self, now: float | None = None) -> list[Straggler | str]:
        """What changed since the last call: a Straggler found (or, with `ended` set, gone), or a run-wide line."""
        now = time.time() if now is None else now
        s = self.settings
        self.judged = False
        if now - self._last_judged < s.every:
            return []
        self._last_judged = now
        with self._lock:
            window = self._window(now)
        if window is None:
            return []
        times, rate, unit = window
        state, changes, self.judged = self.state, [], True
        state.ranks, state.rate, state.unit = times, rate, unit
        healthy_from = (self._first or now) + s.warmup
        if now >= healthy_from and state.straggler is None and not state.run_wide:
            self._healthy.append(rate)
            del self._healthy[:-12]
            if state.busbw_gbs is not None:
                self._healthy_busbw.append(state.busbw_gbs)
                del self._healthy_busbw[:-12]
        base = statistics.median(self._healthy) if len(self._healthy) >= 2 else None
        state.pace = round(rate / base, 2) if base else None
        busiest, slower = _slowest(times)
        figure = self._told(slower, state.pace)
        straggler = state.straggler
        if straggler is None:
            # named only where its own share says so and the figure told is past the line too (on GPUs the
            # run's own slowdown, which a lone straggler sets): never "9% slower" against a 15% line
            if slower >= s.slower and figure >= s.slower and len(times) > 1:
                if self._candidate is None or self._candidate[0] != busiest.rank:
                    self._candidate = (busiest.rank, now)
                elif now - self._candidate[1] >= s.hold:
                    found = Straggler(busiest.rank, busiest.node, self.rank_gpus.get(busiest.rank),
                                      figure, state.pace, self._candidate[1], told=now)
                    with self._lock:
                        found.causes = self._causes(found, now)
                        found.corroborated, found.basis = self._corroborate(found, now)
                    state.straggler, self._candidate = found, None
                    state.events.append(found)
                    changes.append(replace(found, causes=list(found.causes)))   # as it was when found
            else:
                self._candidate = None
        else:
            # kept while it still holds; below the line it is calm, and ends once calm for the hold (its last
            # figure past the line is what stays told meanwhile)
            same = busiest.rank == straggler.rank and slower >= s.slower and figure >= s.slower
            if same:
                straggler.slower, straggler.pace = figure, state.pace
                self._calm_since = None
                if not straggler.corroborated:   # a cause or a witness may show later
                    with self._lock:
                        straggler.corroborated, straggler.basis = self._corroborate(straggler, now)
            elif self._calm_since is None:
                self._calm_since = now
            elif now - self._calm_since >= s.hold:
                straggler.ended, state.straggler, self._calm_since = now, None, None
                changes.append(replace(straggler, causes=list(straggler.causes)))
        changes += self._run_wide(now, state, times)
        return changes

    def _told(self, slower: float, pace: float | None) -> float:
        """How much slower the straggler is, as told. On GPUs the collectives run beside the compute (FSDP's
        prefetch) and the host runs ahead of the GPU, so the shares of the window only rank the ranks; there the
        run's own slowdown, which a lone straggler sets, is the figure (1/pace - 1), once the healthy pace is
        known."""
        if (self.timed or self.gpus) and pace:
            return round(max(0.0, 1 / pace - 1), 2)
        return round(min(slower, 9.99), 2)

    def _run_wide(self, now: float, state: PaceState, times: list[RankTime]) -> list[str]:
        s = self.settings
        if state.pace is None or state.straggler is not None or state.pace >= s.low_pace:
            if self._low_since and state.run_wide:
                state.run_wide = ""
            self._low_since = None
            return []
        self._low_since = self._low_since or now
        if state.run_wide or now - self._low_since < s.hold:
            return []
        waits = statistics.median(t.wait for t in times)
        state.run_wide = (f"every rank is slower: pace {state.pace:.2f}x of this run's healthy pace, no single "
                          f"rank to blame (each waits {waits * 100:.0f}% of the time in collectives); "
                          f"{'the collectives themselves' if waits > 0.5 else 'compute or data on every node'} "
                          f"take the time now")
        gpu_causes = self._gpu_causes()
        if gpu_causes:
            state.run_wide += "; " + "; ".join(gpu_causes)
        busy_nodes = {node: others for node, others in sorted(self._others.items())
                      if node in {t.node for t in times} and others}
        if busy_nodes and waits <= 0.5:
            state.run_wide += "; other processes take CPU there: " + "; ".join(
                f"on {node} pid {o['pid']} ({o['user']}, {o['name']}) {o['share'] * 100:.0f}% of a CPU"
                for node, others in busy_nodes.items() for o in others[:2])
        for node in sorted({t.node for t in times}):
            pressed = self._pressed(node, now - s.window, f"on {node}")
            if pressed:
                state.run_wide += "; " + "; ".join(pressed)
        healthy = statistics.median(self._healthy_busbw) if len(self._healthy_busbw) >= 2 else None
        if healthy and state.busbw_gbs is not None and state.busbw_gbs < 0.7 * healthy:
            state.run_wide += (f"; the collectives move {state.busbw_gbs:.1f} GB/s against {healthy:.1f} GB/s "
                               f"earlier in this run: the network between the nodes slowed (a link or one node "
                               f"pair: `nodectl preflight --full` times each pair)")
        return [state.run_wide]

    def _pressed(self, node: str, since: float, whose: str) -> list[str]:
        """Memory and I/O pressure on `node` since `since` (the share of wall time some of its tasks stalled), each
        named from PRESSED of the time on, with the pages swapped per second."""
        recent = [p for p in self._pressure.get(node, []) if p[0] >= since]
        if len(recent) < 2 or recent[-1][0] <= recent[0][0]:
            return []
        wall, said = recent[-1][0] - recent[0][0], []

        def rate(i):
            return (recent[-1][i] - recent[0][i]) / wall \
                if recent[-1][i] is not None and recent[0][i] is not None else None

        memory, io, swap = rate(1), rate(2), rate(3)
        if memory is not None and memory >= PRESSED:
            said.append(f"{whose} tasks stalled on memory {min(memory, 1) * 100:.0f}% of the time (memory pressure"
                        + (f"; {swap:,.0f} pages swapped per second" if swap and swap >= 1 else "") + ")")
        if io is not None and io >= PRESSED:
            said.append(f"{whose} tasks waited for I/O {min(io, 1) * 100:.0f}% of the time (the disk or file "
                        f"system the data and checkpoints are read from and written to)")
        return said

    def _gpu_causes(self) -> list[str]:
        """What the run's GPUs on every node show that slows every rank: another process on one (pid, user,
        command), clocks held back and why (NVML's clock event reasons)."""
        causes = []
        for node, detail in sorted(self._gpu_detail.items()):
            mine = sorted({self.rank_gpus.get(r) for r, n in self.rank_nodes.items() if n == node} - {None})
            for index in mine:
                gpu = detail.get(str(index))
                if gpu is not None:
                    causes += _gpu_said(gpu, f"GPU {index} of {node}")
        return causes

    def _window(self, now: float, seconds: float | None = None):
        """(per-rank time split, rate, unit) over the last `seconds` (the window), or None while too little is
        known."""
        s = self.settings
        seconds = seconds or s.window
        ranks = sorted(self.rank_nodes)
        by_group: dict[str, list] = defaultdict(list)
        for key, arrivals in self._reached.items():
            by_group[key[0]].append((key, arrivals))
        if not by_group:
            return None
        if self._first is None:
            self._first = min(min(a.values()) for entries in by_group.values() for _, a in entries)
        # the group every rank takes part in (the default group, or the mesh group that spans the run)
        group, entries = max(by_group.items(), key=lambda item: (len(set().union(*(a for _, a in item[1]))),
                                                                  len(item[1])))
        complete = sorted(((max(a.values()), key, a) for key, a in entries if set(a) >= set(ranks)),
                          key=lambda item: item[0])
        recent = [item for item in complete if item[0] >= now - seconds]
        self._forget(now)
        if len(recent) < 4 or recent[-1][0] - recent[0][0] < min(seconds, s.window) / 4:
            return None
        span = recent[-1][0] - recent[0][0]
        self._recent = recent
        waits, timed, with_durations = self._waits(recent, ranks)
        self.timed = timed
        self._bandwidth(with_durations if timed else [], len(ranks))
        times = [RankTime(r, self.rank_nodes[r], busy=round(max(0.0, 1 - waits[r] / span), 3),
                          wait=round(min(1.0, waits[r] / span), 3), data=self._data_share(r, now - seconds))
                 for r in ranks]
        steps = [(t, step) for t, step in self._steps if t >= now - seconds]
        if len(steps) >= 2 and steps[-1][1] > steps[0][1]:
            return times, (steps[-1][1] - steps[0][1]) / (steps[-1][0] - steps[0][0]), "steps/s"
        return times, (len(recent) - 1) / span, "collectives/s"

    def _waits(self, recent: list, ranks: list[int]) -> tuple[dict[int, float], bool, list]:
        """Each of `ranks`' seconds waiting for the others of `ranks` over the window's collectives: the last of
        them to arrive minus its own arrival, or where NCCL timed nearly all of them, its collective's duration
        minus the shortest. Also whether they were timed, and the timed ones."""
        with_durations = [item for item in recent[1:] if set(self._durations.get(item[1], {})) >= set(ranks)]
        timed = len(with_durations) >= 0.9 * len(recent[1:])
        waits = dict.fromkeys(ranks, 0.0)
        for _, key, arrivals in (with_durations if timed else recent[1:]):
            if timed:
                durations = self._durations[key]
                shortest = min(durations[r] for r in ranks)
                for r in ranks:
                    waits[r] += durations[r] - shortest
            else:
                last = max(arrivals[r] for r in ranks)
                for r in ranks:
                    waits[r] += last - arrivals[r]
        return waits, timed, with_durations

    def _corroborate(self, found: Straggler, now: float) -> tuple[bool, str]:
        """Whether the verdict on `found` rests on more than what other ranks say of themselves. The waits that
        point at it are timings each rank reports of itself: one node's ranks claiming to arrive early make any
        other rank look slow. So the verdict stands only when (a) it still holds with each other node's timings
        left out in turn (the rest, and the suspect node's own ranks, still wait for it: no single node's word
        decides), or (b) runctl read a cause on its node that no rank writes (its CPU quota, run queue, steal,
        GPU)."""
        counted = [c for c in found.causes if not c.startswith(DATA_CAUSE)]
        if counted:
            return True, f"its node's own counters: {counted[0]}"
        suspect_node = self.rank_nodes.get(found.rank)
        others = sorted({n for n in self.rank_nodes.values() if n != suspect_node})
        recent = self._recent
        if not others or not recent:
            return False, "no other node's ranks to compare with"
        span = recent[-1][0] - recent[0][0]
        for left_out in others:
            ranks = sorted(r for r, n in self.rank_nodes.items() if n != left_out)
            busy: list[RankTime] = []
            if len(ranks) >= 2 and span > 0:
                waits, _, _ = self._waits(recent, ranks)
                busy = [RankTime(r, self.rank_nodes[r], busy=1 - waits[r] / span, wait=waits[r] / span)
                        for r in ranks]
            busiest, slower = _slowest(busy) if busy else (None, 0.0)
            if busiest is None or busiest.rank != found.rank or slower < self.settings.slower:
                return False, (f"only node {left_out}'s ranks' own timings say it is slower (a rank's timings "
                               f"could be wrong or forged), and nothing read on node {suspect_node} agrees")
        return True, "the ranks of every other node wait for it (each node's timings left out in turn)"

    def _bandwidth(self, timed: list, world: int) -> None:
        """The bus bandwidth the window's NCCL-timed collectives of 1 MiB or more reached: bus bytes over the time
        each took once every rank was there (its shortest duration: the transfer, no rank's wait)."""
        moved, seconds, sizes = 0.0, 0.0, []
        for _, key, _ in timed:
            size, kind = self._moved.get(key, (None, None))
            took = min(self._durations.get(key, {}).values(), default=0.0)
            if size is None or size < BUS_MIN_BYTES or took <= 0 or world < 2:
                continue
            moved += size * BUS_FACTOR[kind](world)
            seconds += took
            sizes.append(size)
        if seconds > 0:
            self.state.busbw_gbs = round(moved / seconds / 1e9, 2)
            self.state.collective_mib = round(statistics.median(sizes) / (1 << 20), 1)

    def _data_share(self, rank: int, since: float) -> float | None:
        """The share of wall time this rank spent getting data since `since`, from its heartbeats' data_s (the
        built-in trainer's); None for a script that does not say."""
        recent = [sample for sample in self._data.get(rank, []) if sample[0] >= since]
        if len(recent) < 2 or recent[-1][0] - recent[0][0] < 1.0 or recent[-1][1] < recent[0][1]:
            return None
        return round(min(1.0, (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0])), 3)

    def _forget(self, now: float) -> None:
        keep_from = now - max(3 * self.settings.window, self.settings.look)
        for key in [k for k, a in self._reached.items() if max(a.values()) < keep_from]:
            del self._reached[key]
            self._durations.pop(key, None)
            self._moved.pop(key, None)

    # the causes ---------------------------------------------------------------------------------------------
    def _causes(self, found: Straggler, now: float) -> list[str]:
        causes = []
        window = self.settings.window
        mine = _rates(self._counters.get(found.rank, []), now - window)
        others = [_rates(self._counters.get(r, []), now - window) for r in self.rank_nodes if r != found.rank]
        others = [o for o in others if o]
        if mine:
            queue, throttled = mine.get("runqueue", 0.0), mine.get("throttled") or 0.0
            usual = statistics.median(o.get("runqueue", 0.0) for o in others) if others else 0.0
            if throttled >= 0.05:   # a throttled thread also counts as waiting on its run queue: said once
                causes.append(f"its cgroup's CPU quota held it back {min(throttled, 1) * 100:.0f}% of the time "
                              f"(CPU throttling)")
            elif queue >= 0.1 and queue >= usual + 0.05:
                load = self._node_cpu.get(found.node)
                said = f" (node load {load[-1][2]:.1f} on {load[-1][3]} CPUs)" if load and load[-1][2] is not None \
                    else ""
                others = self._others.get(found.node) or []
                named = "; ".join(f"pid {o['pid']} ({o['user']}, {o['name']}) {o['share'] * 100:.0f}% of a CPU"
                                  for o in others)
                hidden = self._hidden.get(found.node)
                causes.append(f"its main thread waited for a CPU {min(queue, 1) * 100:.0f}% of the time: "
                              + (f"other processes on node {found.node} take its cores: {named}{said}" if named
                                 else f"another process shares its cores{said}")
                              + (f" (other users' processes are hidden from nodectl's login on node {found.node}: "
                                 f"/proc {hidden})" if hidden and not named else ""))
        shares = {t.rank: t.data for t in self.state.ranks if t.data is not None}
        if found.rank in shares and len(shares) > 1:
            usual = statistics.median(v for r, v in shares.items() if r != found.rank)
            if shares[found.rank] >= usual + 0.1:
                causes.append(f"{DATA_CAUSE} {shares[found.rank] * 100:.0f}% of the time (the other ranks "
                              f"{usual * 100:.0f}%): its batches take longer to make or load")
        steal = _steal(self._node_cpu.get(found.node, []), now - window)
        if steal is not None and steal >= 0.05:
            causes.append(f"the hypervisor took {steal * 100:.0f}% of its node's CPU time (steal)")
        causes += self._pressed(found.node, now - window, "its node's")
        gpu = self._gpu_detail.get(found.node, {}).get(str(found.gpu)) if found.gpu is not None else None
        if gpu is not None:
            causes += _gpu_said(gpu, f"GPU {found.gpu}")
            if gpu.pcie_width and gpu.pcie_width_max and gpu.pcie_width < gpu.pcie_width_max:
                causes.append(f"GPU {found.gpu}'s PCIe link trained down to x{gpu.pcie_width} of "
                              f"x{gpu.pcie_width_max}")
        return causes


def _gpu_said(gpu, which: str) -> list[str]:
    """What a GPU's detail shows that slows its rank(s): the processes on it that are not the run's (pid, user,
    command) and its clocks held back, with NVML's reasons. `which` names it ("GPU 1", "GPU 0 of node0")."""
    said = []
    for other in gpu.others[:3]:
        name = f", {_printable(other['name'])}" if other.get("name") else ""
        said.append(f"another process on {which} (pid {other.get('pid')}, user {_printable(other.get('user'))}{name})")
    held = [text for bit, text in CLOCK_REASONS.items() if gpu.reasons and gpu.reasons & bit]
    if held:
        said.append(f"{which}'s clocks are slowed by {', '.join(held)}")
    return said


def _others_of(found) -> list[dict]:
    """A node's busiest other processes as runctl told them, each {pid, user, name, share}; what is not that (a
    node's words are data) is left out."""
    out = []
    for entry in found if isinstance(found, list) else []:
        if isinstance(entry, dict) and isinstance(entry.get("pid"), int) and _number(entry.get("share")) is not None:
            out.append({"pid": entry["pid"], "user": _printable(entry.get("user")),
                        "name": _printable(entry.get("name")), "share": _number(entry["share"])})
    return out[:OTHERS_TOLD]


OTHERS_TOLD = 3
PRESSED = 0.1    # memory or I/O pressure named from this share of wall time on (some tasks stalled)


def _printable(text) -> str:
    """A process's user or name as told: 32 characters at most, nothing a terminal would act on."""
    return "".join(c if c.isprintable() else "?" for c in str(text or "?")[:32])


def _slowest(times: list[RankTime]) -> tuple[RankTime, float]:
    """The rank busy longest, and how much longer than the median rank (0.9 = 1.9x)."""
    busiest = max(times, key=lambda t: t.busy)
    median = statistics.median(t.busy for t in times)
    return busiest, (busiest.busy / median - 1 if median > 0 else 1.0)


def _rates(samples: list[tuple], since: float) -> dict:
    """Shares of wall time, over the samples since `since`: CPU used, run-queue wait, quota throttling."""
    recent = [s for s in samples if s[0] >= since]
    if len(recent) < 2 or recent[-1][0] <= recent[0][0]:
        return {}
    wall = recent[-1][0] - recent[0][0]
    rates = {"cpu": (recent[-1][1] - recent[0][1]) / wall, "runqueue": (recent[-1][2] - recent[0][2]) / wall}
    if recent[-1][3] is not None and recent[0][3] is not None:
        rates["throttled"] = (recent[-1][3] - recent[0][3]) / wall
    return rates


def _steal(samples: list[tuple], since: float) -> float | None:
    recent = [s for s in samples if s[0] >= since and s[1] is not None]
    if len(recent) < 2 or recent[-1][0] <= recent[0][0] or not recent[-1][3]:
        return None
    return (recent[-1][1] - recent[0][1]) / ((recent[-1][0] - recent[0][0]) * recent[-1][3])


def for_run(run, run_nodes: list) -> PaceWatch:
    """The pace watch of a run (nodectl.runs.Run, its RunNodes): each rank's node and, on GPU nodes, its GPU
    index on that node (its place in the node's CUDA_VISIBLE_DEVICES, or its local rank)."""
    plan = run.read().plan
    envs = {np.node.name: np.env for np in plan.nodes}
    gpus = plan.backend == "nccl"
    rank_gpus: dict[int, str | None] = {}
    for rn in run_nodes:
        visible = [v.strip() for v in str(envs.get(rn.node.name, {}).get("CUDA_VISIBLE_DEVICES", "")).split(",")
                   if v.strip()]
        for local, rank in enumerate(rn.ranks):
            rank_gpus[rank] = (visible[local] if local < len(visible) else str(local)) if gpus else None
    watch = PaceWatch({rank: rn.node.name for rn in run_nodes for rank in rn.ranks}, rank_gpus, gpus=gpus)
    watch.state.events = earlier_stragglers(run.read().pace)   # an earlier attempt's verdicts stay in the record
    return watch


# reading a run record's pace (written by an attached launch; a record is data anyone may have edited) -------------
def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def straggler_from(entry) -> Straggler | None:
    if not isinstance(entry, dict) or not isinstance(entry.get("rank"), int) or not isinstance(entry.get("node"), str):
        return None
    causes = entry.get("causes")
    return Straggler(rank=entry["rank"], node=entry["node"],
                     gpu=entry["gpu"] if isinstance(entry.get("gpu"), str) else None,
                     slower=_number(entry.get("slower")) or 0.0, pace=_number(entry.get("pace")),
                     since=_number(entry.get("since")) or 0.0,
                     causes=[c for c in causes if isinstance(c, str)] if isinstance(causes, list) else [],
                     ended=_number(entry.get("ended")), corroborated=entry.get("corroborated") is True,
                     basis=entry["basis"] if isinstance(entry.get("basis"), str) else "", told=_number(entry.get("told")))


def earlier_stragglers(record) -> list[Straggler]:
    """The straggler events a run's record holds (an earlier attempt's), each ended."""
    if not isinstance(record, dict) or not isinstance(record.get("events"), list):
        return []
    events = [s for s in (straggler_from(e) for e in record["events"]) if s is not None]
    for event in events:
        if event.ended is None:
            event.ended = _number(record.get("time")) or event.since
    return events


RECORD_FRESH = 45.0   # seconds a record's pace stands for the live run (the attached launch writes it every 15)


def current(record, look: PaceState | None, attempt: int = 0) -> tuple[dict | None, dict[int, tuple]]:
    """(the pace to tell, {rank: (busy, wait, data)}) of a live run: the attached launch's verdict from its record while
    it is fresh and of the attempt running now (`attempt`: just after a restart the record still holds the last
    attempt's verdict, which named a rank beside the new attempt's shares), else what one look at the ranks' pace
    files says."""
    fresh = isinstance(record, dict) and (_number(record.get("time")) or 0) >= time.time() - RECORD_FRESH \
        and record.get("attempt", 0) == attempt and record.get("by") != "status"
    looked = look.to_json() if look is not None and look.ranks else None
    chosen = record if fresh else looked
    return chosen, rank_split(looked or chosen)


def looked_record(record, look: PaceState, attempt: int) -> dict | None:
    """What `status` keeps of its one look at a run no attached launch watches (a detached one): the record to
    write, so that `runs` tells the straggler it saw once the run ended; None when the look named none, or one the
    record holds already (the same rank, since it was first seen). Marked as status's: never taken for an
    attached launch's verdict (current)."""
    found = look.straggler
    if found is None or not look.ranks:
        return None
    earlier = earlier_stragglers(record) if isinstance(record, dict) else []
    since, causes = found.since, list(found.causes)
    if isinstance(record, dict) and record.get("by") == "status" and earlier and \
            (earlier[-1].rank, earlier[-1].node) == (found.rank, found.node):
        seen = earlier.pop()   # the same straggler an earlier status saw: one event, from then, with its causes
        since, causes = seen.since, causes or seen.causes
    kept = replace(found, causes=causes, since=since, ended=None)
    return {**look.to_json(), "events": [e.to_json() for e in earlier] + [kept.to_json()], "attempt": attempt,
            "by": "status"}


def pace_lines(record, live: bool = True) -> list[str]:
    """What `status` and `runs` say of a run's pace from its record: the straggler now (or the run-wide line)
    and the pace; with `live` False (the run ended) the stragglers it had."""
    if not isinstance(record, dict):
        return []
    lines = []
    current = straggler_from(record.get("straggler")) if live else None
    pace = _number(record.get("pace"))
    if current is not None:
        lines.append(current.describe())
    elif live and isinstance(record.get("run_wide"), str) and record["run_wide"]:
        lines.append(record["run_wide"])
    elif live and pace is not None:
        lines.append(f"pace {pace:.2f}x of this run's healthy pace; no straggler")
    split = record.get("split")
    if isinstance(split, str) and split:
        lines.append(split if live else split.replace("where the time goes", "where the time went (last window)"))
    if not live:
        for event in earlier_stragglers(record)[-3:]:
            lasted = f" for {event.ended - event.since:.0f}s" if event.ended else ""
            lines.append(f"had a straggler{lasted}: rank {event.rank} on node {event.node}, "
                         f"{event.slower * 100:.0f}% slower" + (f" ({'; '.join(event.causes)})" if event.causes
                                                                else ""))
    return lines


def rank_split(record) -> dict[int, tuple]:
    """{rank: (busy share, wait share, data share or None)} from a record's pace."""
    if not isinstance(record, dict) or not isinstance(record.get("ranks"), list):
        return {}
    out = {}
    for entry in record["ranks"]:
        if isinstance(entry, dict) and isinstance(entry.get("rank"), int):
            busy, wait = _number(entry.get("busy")), _number(entry.get("wait"))
            if busy is not None and wait is not None:
                out[entry["rank"]] = (busy, wait, _number(entry.get("data")))
    return out
