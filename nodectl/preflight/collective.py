"""The collective test: a short torchrun job through the launch pipeline (nodectl/job.py), and what its logs say of NCCL's
transports. Parsing is pure and unit-tested on saved log lines."""
from __future__ import annotations

import json
import re
import tempfile
import time
from dataclasses import replace

from nodectl import sync
from nodectl.errors import ignore_signals_while_cleaning
from nodectl.inventory import Inventory
from nodectl.job import JobSpec, StartFailed, plan_job, record_job, settle_job, start_job, stop_run
from nodectl.preflight.verdict import FAIL, PASS, WARN, CheckResult
from nodectl.runs import RunState
from nodectl.transport import Cluster
from nodectl.watch import stop_nodes, tail_lines, wait_for_end

TRANSPORT_RE = re.compile(r"via (P2P/[\w/]+|SHM/[\w/]+|NET/IB[\w/]*|NET/Socket[\w/]*|NET/[\w/]+|NVLS[\w/]*|"
                          r"CollNet[\w/]*)")
GPU_MAX, GPU_FULL_MAX, CPU_MAX = 1 << 30, 4 << 30, 64 << 20


def transports_in(log: str) -> dict[str, int]:
    """How many NCCL connections used each transport: {"P2P/CUMEM/read": 24, "NET/IB/0/GDRDMA": 8, ...}."""
    counts: dict[str, int] = {}
    for match in TRANSPORT_RE.finditer(log):
        counts[match[1]] = counts.get(match[1], 0) + 1
    return counts


def result_in(log: str) -> dict | None:
    for line in reversed(log.splitlines()):
        if line.startswith("NODECTL_COLLECTIVE "):
            return json.loads(line.split(" ", 1)[1])
    return None


def judge_collective(result: dict | None, transports: dict[str, int], ib_present: bool, nnodes: int,
                     failure: str | None, run_id: str | None = None) -> list[CheckResult]:
    if failure or result is None:
        return [CheckResult("collective", "cluster", FAIL, f"the all-reduce job failed: {failure or 'no result'}",
                            f"see every rank's log with nodectl tail all --run {run_id or 'RUN'} (NCCL_DEBUG=INFO "
                            f"is set there); a peer that cannot be reached on its ephemeral ports while the master "
                            f"port works is a firewall between the nodes (NODE_SETUP.md, section 4)")]
    wrong = [s["bytes"] for s in result["sizes"] if not s["ok"]]
    out = []
    if wrong:
        out.append(CheckResult("collective", "cluster", FAIL, f"all-reduce returned wrong sums at {wrong[:3]} bytes",
                               "a GPU or link corrupts data: run preflight --full to find the node pair"))
    else:
        largest = result["sizes"][-1]
        out.append(CheckResult("collective", "cluster", PASS,
                               f"{result['backend']} all-reduce correct on {result['world']} ranks; busbw "
                               f"{largest['busbw_gbs']:.1f} GB/s at {largest['bytes'] >> 20} MiB"))
    if transports:
        used = ", ".join(f"{name} x{count}" for name, count in sorted(transports.items()))
        socket = any(name.startswith("NET/Socket") for name in transports)
        if ib_present and socket and nnodes > 1:
            out.append(CheckResult("nccl transport", "cluster", FAIL, f"InfiniBand is present but NCCL used {used}",
                                   "NCCL fell back to TCP sockets: make sure NCCL_IB_DISABLE is unset or 0, name "
                                   "the HCAs with NCCL_IB_HCA, load nvidia-peermem for GPUDirect RDMA",
                                   {"NCCL_IB_DISABLE": "0"}))
        elif socket and nnodes > 1:
            out.append(CheckResult("nccl transport", "cluster", WARN, used, "inter-node traffic on TCP sockets"))
        elif any(name.startswith("NET/IB") for name in transports) and not any("GDRDMA" in n for n in transports):
            out.append(CheckResult("nccl transport", "cluster", WARN, f"{used}: InfiniBand without GPUDirect RDMA",
                                   "every message is staged through host memory: load nvidia_peermem (modprobe "
                                   "nvidia_peermem), or use the open kernel modules for DMA-BUF; NCCL then shows "
                                   "NET/IB/<n>/GDRDMA"))
        else:
            out.append(CheckResult("nccl transport", "cluster", PASS, used))
    return out


PAIR_GPU_MAX, PAIR_CPU_MAX = 256 << 20, 16 << 20
DEFAULT_DEADLINE_S = 120  # per peer connection and per collective; torch's own: 10 min (NCCL), 30 min (gloo)
SLOW_PAIR = 0.7


def judge_pairs(pairs: list[dict]) -> list[CheckResult]:
    """Pairs well under the median busbw point at a slow node: the one that is in every slow pair."""
    measured = [p for p in pairs if p.get("busbw_gbs")]
    failed = [p for p in pairs if not p.get("busbw_gbs")]
    out = [CheckResult("node pair", "cluster", FAIL, f"{'+'.join(p['nodes'])}: {p.get('error')}",
                       "run a two-node launch on that pair to see its logs") for p in failed]
    if len(measured) < 2:
        return out
    median = sorted(p["busbw_gbs"] for p in measured)[len(measured) // 2]
    slow = [p for p in measured if p["busbw_gbs"] < SLOW_PAIR * median]
    detail = "; ".join(f"{'+'.join(p['nodes'])} {p['busbw_gbs']:.1f} GB/s" for p in measured)
    if not slow:
        return out + [CheckResult("node pairs", "cluster", PASS, detail)]
    suspects = set(slow[0]["nodes"]).intersection(*(set(p["nodes"]) for p in slow))
    culprit = ", ".join(sorted(suspects)) or "no single node"
    return out + [CheckResult("node pairs", "cluster", WARN, f"slow pairs (under {SLOW_PAIR:.0%} of the median "
                                                             f"{median:.1f} GB/s): {detail}; common node: {culprit}",
                              f"check {culprit}'s NIC, cabling and PCIe; or leave it out with --exclude")]


def run_pairs(inventory: Inventory, cluster: Cluster, *, gpus: int | None, connect_timeout: float,
              deadline: float | None = None, facts: dict | None = None) -> list[dict]:
    """The collective on each ring neighbour pair (node i with node i+1), one pair at a time."""
    nodes, pairs = inventory.nodes, []
    for i in range(len(nodes)):
        pair = (nodes[i], nodes[(i + 1) % len(nodes)])
        sub = replace(inventory, nodes=tuple(replace(n, index=k) for k, n in enumerate(pair)))
        limit = PAIR_GPU_MAX if pair[0].device == "cuda" else PAIR_CPU_MAX
        # only the largest size: the pair's bandwidth is what finds a slow node, and each smaller size cost ~1 s
        result, _, failure, run_id = run_collective(sub, cluster, gpus=gpus, full=False,
                                                    connect_timeout=connect_timeout, max_bytes=limit, min_bytes=limit,
                                                    deadline=deadline, facts=facts)
        entry = {"nodes": [n.name for n in pair], "run": run_id}
        if result and all(s["ok"] for s in result["sizes"]):
            entry["busbw_gbs"] = result["sizes"][-1]["busbw_gbs"]
        else:
            entry["error"] = failure or "wrong sums"
        pairs.append(entry)
    return pairs


def run_collective(inventory: Inventory, cluster: Cluster, *, gpus: int | None, full: bool,
                   connect_timeout: float, grace: float = 5.0,
                   max_bytes: int | None = None,
                   min_bytes: int | None = None, deadline: float | None = None,
                   facts: dict | None = None) -> tuple[dict | None, dict[str, int], str | None, str]:
    """(result, transports, failure, run id) of the all-reduce job on every selected node and rank."""
    gpu_run = inventory.nodes[0].device == "cuda"
    max_bytes = max_bytes or ((GPU_FULL_MAX if full else GPU_MAX) if gpu_run else CPU_MAX)
    if gpu_run:  # NCCL says which transport each connection took
        inventory = replace(inventory, nodes=tuple(replace(n, env={"NCCL_DEBUG": "INFO", **n.env})
                                                   for n in inventory.nodes))
    empty = tempfile.mkdtemp(prefix="nodectl-preflight-")
    sweep = ("--max-bytes", str(max_bytes), *(("--min-bytes", str(min_bytes)) if min_bytes else ()),
             "--deadline-s", str(deadline or DEFAULT_DEADLINE_S))
    spec = JobSpec(inventory, command=("../lib/collective.py", *sweep), sync_dir=empty,
                   files=tuple(sync.nodectl_files(False, None, ("collective.py",))), gpus=gpus, facts=facts or {},
                   kind="preflight", argv=("nodectl", "preflight", "(collective test)"))
    job = settle_job(plan_job(spec), cluster)
    run = record_job(job)
    run_nodes = run.nodes()
    try:
        start_job(job, run, cluster, grace=grace)
        outcome, failure = wait_for_end(cluster, run_nodes, None, lost_after=connect_timeout + 5)
    except StartFailed as failed:
        return None, {}, str(failed.message), job.run_id
    except KeyboardInterrupt:  # the user stopped preflight: its job must not outlive it
        ignore_signals_while_cleaning()
        stop_run(run, cluster, grace, RunState.INTERRUPTED)
        raise
    if outcome != RunState.SUCCEEDED:
        stop_nodes(cluster, run_nodes, grace)
    run.update(state=outcome, ended=time.time())
    logs = ""
    for run_node in run_nodes:
        logs += tail_lines(cluster, run_node, [run_node.ranks[0]], 5000).get(run_node.ranks[0], {}).get("text", "")
    return result_in(logs), transports_in(logs), _failure_text(cluster, run_nodes, failure), job.run_id


def _failure_text(cluster: Cluster, run_nodes, failure) -> str | None:
    """The failure, with the failing rank's last meaningful lines (the connection it could not make is there)."""
    if failure is None:
        return None
    run_node = next((rn for rn in run_nodes if rn.node.name == failure.node), None)
    if failure.rank is None or run_node is None:
        return failure.describe()
    try:
        text = tail_lines(cluster, run_node, [failure.rank], 60).get(failure.rank, {}).get("text", "")
    except Exception:  # the node may be the reason: the failure alone still says what happened
        return failure.describe()
    lines = [line.strip() for line in text.splitlines()
             if line.strip() and " NCCL INFO " not in line and not line.lstrip().startswith(("File ", "^"))]
    unreachable = [line.split(PEER_MARKER, 1)[1].strip() for line in lines if PEER_MARKER in line]
    if unreachable:  # launchers/collective.py named the connections it could not make
        return failure.describe() + ": " + " | ".join(unreachable[:4])
    return failure.describe() + (": " + " | ".join(lines[-4:]) if lines else "")


PEER_MARKER = "NODECTL_PEER_UNREACHABLE"
