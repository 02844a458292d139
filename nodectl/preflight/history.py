"""Preflight remembers: each measured preflight's figures per GPU (by UUID), per node pair and for the cluster's
all-reduce, kept in the user's registry with the time and the software versions, and each new preflight judged
against every part's own recent past. One-shot checks miss a part that fails slowly (a GPU that lost 15% of its
GEMM rate since last month, a link drifting down); fleet tools catch it by comparing a part with its own history
and its peers (the peers: gpu.py's cluster medians). Storage is one JSON line per preflight
(`<state dir>/preflight-history.jsonl`), bounded; judging is pure and unit-tested on saved entries."""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

from nodectl.preflight.checks import MEASURED, check
from nodectl.probe_report import ProbeReport
from nodectl.preflight.verdict import FAIL, WARN, CheckResult

HISTORY_FILE = "preflight-history.jsonl"
KEPT = 400                 # entries kept; older ones are dropped when the file passes KEPT + 100
WINDOW = 10                # a part's own median: its last WINDOW measurements
DRIFT_WARN, DRIFT_FAIL = 0.10, 0.20   # below its own median by this share: warn, fail (preflight --drift-warn/-fail)
METRICS = {"gemm_tflops": ("bf16 GEMM", "TFLOP/s"), "hbm_gbps": ("HBM", "GB/s"), "busbw_gbs": ("busbw", "GB/s")}
# Noisy figures (CPU/gloo busbw on shared cores) are judged from their NOISY_PAST'th earlier measurement on, with a
# wider band: half their own median warns, a fifth fails (a 22x fall of a node pair's all-reduce failed nobody).
NOISY_PAST, NOISY_WARN, NOISY_FAIL = 3, 0.50, 0.80
# The preflight's own time (lower is better): over SLOW_PREFLIGHT times its median warns, never fails on its own
SLOW_PREFLIGHT = 3.0


@dataclass(frozen=True)
class Figure:
    """One measured figure of one part: `key` names the part across preflights (a GPU by its UUID, a pair of
    nodes, the all-reduce over a set of nodes at one size); higher is better for every metric kept."""
    key: str
    metric: str
    value: float
    node: str        # where a verdict about it is reported ("cluster" for the all-reduce and pairs)
    label: str       # how a person names it: "node1 GPU 3 (GPU-7f...)", "node0+node1"
    judged: bool = True   # False: a noisy figure (CPU/gloo busbw, a preflight's time), judged with a wider band
    host: str | None = None   # a GPU's node's SSH host key as the controller verified it (None: a local node)

    def to_json(self) -> dict:
        kept = {"key": self.key, "metric": self.metric, "value": self.value, "node": self.node, "label": self.label,
                "judged": self.judged}
        return {**kept, "host": self.host} if self.host else kept

    def measured_by_same_node(self, found: Mapping) -> bool:
        """Whether a kept figure of the same part was measured by the node this one was: same name and, where
        both were recorded, same host key (a reinstalled or impersonating node starts a new past)."""
        if not self.key.startswith("gpu:"):
            return True
        if found.get("node") != self.node:
            return False
        return not (self.host and found.get("host")) or found.get("host") == self.host


def figures_of(reports: Mapping[str, Mapping], gpu_jobs: Mapping[str, Mapping],
               collective: Mapping | None) -> list[Figure]:
    """The figures a measured preflight produced: each GPU's GEMM and HBM rates (the GPU job), the all-reduce's
    busbw at its largest size, each node pair's busbw (--full)."""
    out = []
    for node, job in sorted(gpu_jobs.items()):
        uuids = {d.index: d.uuid for d in ProbeReport.of(reports.get(node) or {}).gpus.devices}
        for device in job.get("devices") or []:
            if not isinstance(device, Mapping):
                continue
            uuid = uuids.get(device.get("index")) or f"{node}/{device.get('index')}"
            label = f"{node} GPU {device.get('index')} ({str(uuid)[:12]})"
            host = job.get("host_key") if isinstance(job.get("host_key"), str) else None
            out += [Figure(f"gpu:{uuid}", metric, float(device[metric]), node, label, host=host)
                    for metric in ("gemm_tflops", "hbm_gbps") if isinstance(device.get(metric), (int, float))]
    sizes = [s for s in (collective or {}).get("sizes") or [] if isinstance(s, Mapping) and s.get("busbw_gbs")]
    nccl = (collective or {}).get("backend") == "nccl"
    if sizes:
        largest = max(sizes, key=lambda s: s.get("bytes") or 0)
        nodes = "+".join(sorted(reports))
        out.append(Figure(f"allreduce:{nodes}:{largest.get('bytes')}", "busbw_gbs", float(largest["busbw_gbs"]),
                          "cluster", f"all-reduce of {int(largest.get('bytes') or 0) >> 20} MiB over {nodes}", nccl))
    for pair in (collective or {}).get("pairs") or []:
        if isinstance(pair, Mapping) and pair.get("busbw_gbs") and pair.get("nodes"):
            name = "+".join(sorted(pair["nodes"]))
            out.append(Figure(f"pair:{name}", "busbw_gbs", float(pair["busbw_gbs"]), "cluster", f"pair {name}",
                              nccl))
    return out


def curve_of(collective: Mapping | None) -> list:
    """The all-reduce's busbw at every size it measured ([[bytes, GB/s]...]), NCCL only (gloo's is not judged)."""
    if not collective or collective.get("backend") != "nccl":
        return []
    return [[int(s["bytes"]), round(float(s["busbw_gbs"]), 2)] for s in collective.get("sizes") or []
            if isinstance(s, Mapping) and isinstance(s.get("bytes"), int)
            and isinstance(s.get("busbw_gbs"), (int, float))]


def versions_of(reports: Mapping[str, Mapping]) -> dict:
    typed = {node: ProbeReport.of(r) for node, r in reports.items()}
    return {node: {"torch": r.torch.version, "nccl": r.torch.nccl, "driver": r.gpus.driver}
            for node, r in typed.items()}


@dataclass(frozen=True, kw_only=True)
class Drift:
    """What the history says of today's figures: the verdicts (one per part that fell), one line for all, and
    the (key, metric) of each figure that fell."""
    results: tuple[CheckResult, ...] = ()
    summary: str = ""
    fallen: frozenset[tuple[str, str]] = frozenset()


@check("history", "cluster", scope="job", tiers=MEASURED,
       doc=(("history",
            "each measured figure (a GPU's bf16 GEMM and HBM rates by its UUID, the all-reduce's busbw at its "
            "largest size, each node pair's busbw with `--full`) and the preflight's own time against the same "
            f"part's median over its last {WINDOW} preflights, kept in the user's registry (`preflight --history "
            "[NODE]` shows them)",
            f"warn {DRIFT_WARN:.0%} below its own median, fail {DRIFT_FAIL:.0%} below (`--drift-warn`, "
            "`--drift-fail`), naming the part, both figures and when it last measured well; CPU (gloo) figures from "
            f"their {NOISY_PAST}rd past on, warn {NOISY_WARN:.0%} below, fail {NOISY_FAIL:.0%} below; the "
            f"preflight's time warns past {SLOW_PREFLIGHT:g}x its median; a part without a past is recorded, not "
            "judged",
            "fail-slow parts (a GPU losing its GEMM rate, a link drifting down) pass every one-shot check; fleet "
            "health checks compare a part with its own past"),))
def judge_history(today: list[Figure], past: list[dict], warn: float = DRIFT_WARN,
                  fail: float = DRIFT_FAIL) -> Drift:
    """Today's figures against each part's median over its last WINDOW entries in `past` (oldest first)."""
    results, matched, parts_seen, fallen = [], 0, 0, []
    disputed = _claimed_twice(today, past)
    for key, nodes in sorted(disputed.items()):
        results.append(CheckResult(
            "history", "cluster", WARN,
            f"{key[len('gpu:'):]} is reported by {', '.join(sorted(nodes))}: a GPU's UUID is one GPU's, so its past "
            f"judges neither node's figures",
            "a node that reports another node's GPU is misconfigured (a cloned image's cached inventory?) or "
            "compromised: compare `nvidia-smi -L` on each"))
    for figure in (f for f in today if f.key not in disputed):
        earlier = [(entry.get("time", 0), found["value"]) for entry in past for found in entry.get("figures") or []
                   if isinstance(found, dict) and found.get("key") == figure.key
                   and found.get("metric") == figure.metric and figure.measured_by_same_node(found)
                   and isinstance(found.get("value"), (int, float))][-WINDOW:]
        if len(earlier) < (1 if figure.judged else NOISY_PAST):
            continue
        parts_seen += 1
        median = statistics.median(v for _, v in earlier)
        if median <= 0:
            continue
        if figure.metric == "seconds":
            if figure.value <= SLOW_PREFLIGHT * median:
                matched += 1
                continue
            results.append(CheckResult(
                "history", "cluster", WARN,
                f"{figure.label} took {figure.value:.0f} s, {figure.value / median:.1f}x its own median of "
                f"{median:.0f} s over {len(earlier)} earlier preflight(s)",
                "a node slow to answer (its load, a hung mount, a slow name lookup) or a slower link: the per-node "
                "times are in --json (reports.<node>.elapsed_s); `nodectl preflight --history` shows the past"))
            continue
        band_warn, band_fail = (warn, fail) if figure.judged else (max(warn, NOISY_WARN), max(fail, NOISY_FAIL))
        drop = 1 - figure.value / median
        if drop < band_warn:
            matched += 1
            continue
        fallen.append((figure.key, figure.metric))
        well = [(t, v) for t, v in earlier if v >= median * (1 - warn)]
        since = f"; last measured well {_when(well[-1][0])} ({well[-1][1]:.1f})" if well else ""
        what, unit = METRICS.get(figure.metric, (figure.metric, ""))
        noisy = "" if figure.judged else " (a CPU figure: judged with a wider band)"
        results.append(CheckResult(
            "history", figure.node, FAIL if drop >= band_fail else WARN,
            f"{figure.label}: {what} {figure.value:.1f} {unit}, {drop:.0%} below its own median of {median:.1f} "
            f"over {len(earlier)} earlier preflight(s){since}{noisy}",
            "a part losing speed fails slowly: look at its clocks and temperature (nvidia-smi -q -d "
            "PERFORMANCE,TEMPERATURE), its PCIe link and the node's load; `nodectl preflight --history "
            f"{figure.node if figure.node != 'cluster' else ''}`".rstrip() + " shows its figures over time"))
    if not today:
        summary = ""
    elif not parts_seen:
        summary = (f"history: {len(today)} figure(s) recorded, without enough past to judge (CPU figures and "
                   f"the preflight's time from their {NOISY_PAST}rd past on)")
    elif not results:
        summary = (f"history: matches its own past ({matched} figure(s) within {warn:.0%} of their medians over up "
                   f"to {WINDOW} earlier preflights)")
    else:
        summary = f"history: {len(results)} of {parts_seen} figure(s) below their own past (above)"
    return Drift(results=tuple(results), summary=summary, fallen=frozenset(fallen))


def _claimed_twice(today: list[Figure], past: list[dict]) -> dict[str, set[str]]:
    """GPU keys (by UUID, which the node itself reports) that more than one node claims, today or in the kept past:
    a GPU is judged only against figures its own node measured, and a UUID two nodes claim judges neither (a
    compromised node claiming another's GPU with inflated figures would otherwise fail that node later)."""
    claims: dict[str, set[str]] = {}
    for figure in today:
        if figure.key.startswith("gpu:"):
            claims.setdefault(figure.key, set()).add(figure.node)
    for entry in past:
        for found in entry.get("figures") or []:
            if isinstance(found, dict) and found.get("key") in claims and isinstance(found.get("node"), str):
                claims[found["key"]].add(found["node"])
    return {key: nodes for key, nodes in claims.items() if len(nodes) > 1}


STRAGGLER_DAYS = 14       # a node named a straggler in runs of the last STRAGGLER_DAYS...
STRAGGLER_RUNS = 2        # ...at least this many of them is warned of before the next run


@check("stragglers", "cluster", scope="job",
       doc=(("stragglers",
             "the straggler verdicts of the runs an attached launch watched (kept in the same registry): the nodes "
             f"a verdict named in at least {STRAGGLER_RUNS} runs of the last {STRAGGLER_DAYS} days",
             "warn, naming the node, its runs, how much slower and the causes seen",
             "a node that held back its last runs will hold back the next: a shared GPU, a throttled CPU or a "
             "slow link stays where it is"),))
def judge_stragglers(nodes: list[str], past: list[dict], now: float | None = None) -> list[CheckResult]:
    """The nodes of `nodes` that straggler verdicts named in STRAGGLER_RUNS runs or more lately."""
    since = (now or time.time()) - STRAGGLER_DAYS * 86400
    named: dict[str, list[dict]] = {}
    for entry in past:
        verdict = entry.get("straggler")
        if isinstance(verdict, dict) and isinstance(verdict.get("node"), str) and verdict["node"] in nodes \
                and isinstance(entry.get("time"), (int, float)) and entry["time"] >= since:
            named.setdefault(verdict["node"], []).append({**verdict, "time": entry["time"]})
    results = []
    for node, verdicts in sorted(named.items()):
        runs = sorted({str(v.get("run")) for v in verdicts})
        if len(runs) < STRAGGLER_RUNS:
            continue
        last = verdicts[-1]
        slower = last.get("slower") if isinstance(last.get("slower"), (int, float)) else None
        causes = [c for c in last.get("causes") or [] if isinstance(c, str)]
        results.append(CheckResult(
            "stragglers", node, WARN,
            f"{node} held back {len(runs)} runs in the last {STRAGGLER_DAYS} days (the last {_when(last['time'])}, "
            f"run {last.get('run')}: rank {last.get('rank')}"
            + (f", {slower:.0%} slower" if slower is not None else "")
            + (f"; {'; '.join(causes)}" if causes else "; no cause seen") + ")",
            "find what slows it (another process on its GPUs, a CPU quota, its clocks, its link) before the next "
            "run, or leave it out (--exclude); `launch --on-straggler exclude` does it during a run"))
    return results


HARDWARE_DAYS = 30        # a part's events during the runs of the last HARDWARE_DAYS are named before the next


@check("hardware", "cluster", scope="job",
       doc=(("hardware history",
             "what the parts of the nodes did during the runs an attached launch watched (kept in the same "
             f"registry): Xid events, ECC and row-remap counts that rose, GPUs lost, port error counters, in the last "
             f"{HARDWARE_DAYS} days",
             "warn, naming the part, the node, the event, how often, in how many runs and when last",
             "a part that failed during runs fails again: a lemon GPU or a flapping link is named before it costs "
             "the next run"),))
def judge_hardware(nodes: list[str], past: list[dict], now: float | None = None) -> list[CheckResult]:
    """One warning per part of `nodes` and event kind seen during runs lately: "GPU 3 of gpu07: 2 Xid 79 (...) in
    2 runs of the last 30 days"."""
    since = (now or time.time()) - HARDWARE_DAYS * 86400
    seen: dict[tuple[str, str, str], dict] = {}
    for entry in past:
        event = entry.get("hardware")
        if not (isinstance(event, dict) and event.get("node") in nodes and isinstance(event.get("part"), str)
                and isinstance(event.get("counter"), str) and isinstance(entry.get("time"), (int, float))
                and entry["time"] >= since):
            continue
        rise = event.get("rise") if isinstance(event.get("rise"), int) and not isinstance(event.get("rise"), bool) \
            else 1
        kept = seen.setdefault((event["node"], event["part"], event["counter"]),
                               {"runs": {}, "last": 0.0, "fatal": False, "run": None})
        run = str(event.get("run"))
        kept["runs"][run] = max(kept["runs"].get(run, 0), rise)   # told again as it rose: the run's largest
        kept["fatal"] = kept["fatal"] or bool(event.get("fatal"))
        if entry["time"] >= kept["last"]:
            kept["last"], kept["run"] = entry["time"], run
    results = []
    for (node, part, counter), kept in sorted(seen.items()):
        total, runs = sum(kept["runs"].values()), len(kept["runs"])
        what = f"lost {total} time(s)" if counter == "lost" else \
            f"{total} {counter}" if counter.startswith("Xid") else f"{counter} rose by {total}"
        results.append(CheckResult(
            "hardware", node, WARN,
            f"{part} of {node}: {what} in {runs} run(s) of the last {HARDWARE_DAYS} days (the last "
            f"{_when(kept['last'])}, run {kept['run']})" + (": it stopped a run" if kept["fatal"] else ""),
            f"have {part} of {node} checked (nvidia-smi -q, the kernel log; for a port, its cable and switch) before "
            f"the next run, or leave {node} out (--exclude)"))
    return results


def _when(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(timestamp))


class History:
    """The history file: read whole (bounded), appended one line per measured preflight."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / HISTORY_FILE

    def entries(self) -> list[dict]:
        try:
            lines = self.path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return []
        out = []
        for line in lines:
            try:
                entry = json.loads(line)
            except (ValueError, RecursionError):
                continue   # a damaged line costs that entry, never the history
            if isinstance(entry, dict) and isinstance(entry.get("figures"), list):
                out.append(entry)
        return out

    def add(self, figures: Iterable[Figure], versions: Mapping, nodes: list[str], when: float | None = None,
            curve: list | None = None) -> None:
        entry = {"time": when or time.time(), "nodes": nodes, "versions": dict(versions),
                 "figures": [f.to_json() for f in figures]}
        if curve:
            entry["allreduce_curve"] = curve   # [[bytes, busbw GB/s]...]: a run's collectives are set against it
        self._append(entry)

    def _append(self, entry: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(entry) + "\n")
        entries = self.entries()
        if len(entries) > KEPT + 100:
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text("".join(json.dumps(e) + "\n" for e in entries[-KEPT:]))
            os.replace(tmp, self.path)

    def add_straggler(self, run_id: str, straggler: Mapping, when: float | None = None) -> None:
        """A straggler verdict of a run (nodectl.pace.Straggler's JSON): its node, rank, how much slower, causes."""
        kept = {k: straggler.get(k) for k in ("node", "rank", "gpu", "slower", "pace", "causes", "basis")}
        self._append({"time": when or time.time(), "nodes": [straggler.get("node")], "versions": {}, "figures": [],
                      "straggler": {"run": run_id, **kept}})

    def add_failure(self, run_id: str, failure: Mapping, when: float | None = None) -> None:
        """A run's attempt that failed on a node (the launch's failure record): its kind, rank, exit code and
        description, for `preflight --history NODE` to show beside the node's figures."""
        kept = {k: failure.get(k) for k in ("kind", "rank", "code")}
        kept["description"] = str(failure.get("description") or "")[:FAILURE_KEPT]
        self._append({"time": when or time.time(), "nodes": [failure.get("node")], "versions": {}, "figures": [],
                      "failure": {"run": run_id, "node": failure.get("node"), **kept}})

    def add_hardware(self, run_id: str, node: str, event, when: float | None = None) -> None:
        """A part's event during a run (an Xid, a counter that rose, a GPU lost): the part, what and how much.
        Told again as it rises further, the newest line of a run's part and counter is what counts."""
        self._append({"time": when or time.time(), "nodes": [node], "versions": {}, "figures": [],
                      "hardware": {"run": run_id, "node": node, "part": event.part, "counter": event.counter,
                                   "rise": event.rise, "fatal": event.fatal,
                                   "text": (event.text or "")[:FAILURE_KEPT]}})

    def latest_allreduce(self, nodes: Iterable[str]) -> dict | None:
        """The newest NCCL all-reduce measured on exactly these nodes, for a run's collectives to be set against
        (nodectl/pace.py): {busbw_gbs, mib, time} at its largest size, and `curve` ([[bytes, busbw]...]) where the
        preflight kept every size; None without one."""
        prefix = f"allreduce:{'+'.join(sorted(nodes))}:"
        for entry in reversed(self.entries()):
            for figure in entry["figures"]:
                if isinstance(figure, dict) and str(figure.get("key", "")).startswith(prefix) \
                        and figure.get("judged") and isinstance(figure.get("value"), (int, float)):
                    size = figure["key"][len(prefix):]
                    curve = [[int(b), float(v)] for b, v in (entry.get("allreduce_curve") or [])
                             if isinstance(b, int) and isinstance(v, (int, float))] \
                        if isinstance(entry.get("allreduce_curve"), list) and all(
                            isinstance(p, list) and len(p) == 2 for p in entry["allreduce_curve"]) else []
                    return {"busbw_gbs": float(figure["value"]), "time": entry.get("time"),
                            "mib": int(size) / (1 << 20) if size.isdigit() else 0.0, "curve": curve}
        return None

    def rows(self, node: str | None = None) -> list[dict]:
        """Every recorded figure (of `node`'s GPUs, its pairs and the all-reduces it took part in), oldest first."""
        out = []
        for entry in self.entries():
            for figure in entry["figures"]:
                if isinstance(figure, dict) and (not node or _concerns(figure, node)):
                    out.append({"time": entry.get("time", 0), **figure})
        return out

    def events(self, node: str | None = None) -> list[dict]:
        """What runs saw of the nodes (of `node`), oldest first: straggler verdicts and failures, each
        {"time", "event": "straggler" | "failure" | "hardware", "node", "run", ...its record}."""
        out = []
        for entry in self.entries():
            for event in ("straggler", "failure", "hardware"):
                record = entry.get(event)
                if isinstance(record, dict) and isinstance(record.get("node"), str) \
                        and (not node or record["node"] == node):
                    out.append({"time": entry.get("time", 0), "event": event, **record})
        return out


FAILURE_KEPT = 400   # characters of a failure's description kept in the history


def _concerns(figure: Mapping, node: str) -> bool:
    return figure.get("node") == node or node in str(figure.get("label", "")).replace("+", " ").split()
