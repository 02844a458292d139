"""The collective test: a short torchrun job through the launch pipeline (nodectl/job.py), and what its logs say of NCCL's
transports. Parsing is pure and unit-tested on saved log lines."""
from __future__ import annotations

import tempfile
import time
from dataclasses import replace

from nodectl.remote import sync
from nodectl.errors import ignore_signals_while_cleaning
from nodectl.inventory import Inventory
from nodectl.job import JobSpec, StartFailed, plan_job, record_job, settle_job, start_job, stop_run
from nodectl.preflight.network import result_in, transports_in
from nodectl.runs import RunState
from nodectl.remote.transport import Cluster
from nodectl.remote.answers import NO_LOG
from nodectl.watch import stop_nodes, tail_lines, wait_for_end

GPU_MAX, GPU_FULL_MAX, CPU_MAX = 1 << 30, 4 << 30, 64 << 20  # the all-reduce's largest message


PAIR_GPU_MAX, PAIR_CPU_MAX = 256 << 20, 16 << 20
DEFAULT_DEADLINE_S = 120  # per peer connection and per collective; torch's own: 10 min (NCCL), 30 min (gloo)


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
        stop_run(run, cluster, grace, RunState.INTERRUPTED, remove_unstarted=True)
        raise
    if outcome != RunState.SUCCEEDED:
        stop_nodes(cluster, run_nodes, grace)
    run.update(state=outcome, ended=time.time())
    logs = ""
    for run_node in run_nodes:
        logs += tail_lines(cluster, run_node, [run_node.ranks[0]], 5000).get(run_node.ranks[0], NO_LOG).text
    return result_in(logs), transports_in(logs), _failure_text(cluster, run_nodes, failure), job.run_id


def _failure_text(cluster: Cluster, run_nodes, failure) -> str | None:
    """The failure, with the failing rank's last meaningful lines (the connection it could not make is there)."""
    if failure is None:
        return None
    run_node = next((rn for rn in run_nodes if rn.node.name == failure.node), None)
    if failure.rank is None or run_node is None:
        return failure.describe()
    try:
        text = tail_lines(cluster, run_node, [failure.rank], 60).get(failure.rank, NO_LOG).text
    except Exception:  # the node may be the reason: the failure alone still says what happened
        return failure.describe()
    lines = [line.strip() for line in text.splitlines()
             if line.strip() and " NCCL INFO " not in line and not line.lstrip().startswith(("File ", "^"))]
    unreachable = [line.split(PEER_MARKER, 1)[1].strip() for line in lines if PEER_MARKER in line]
    if unreachable:  # launchers/collective.py named the connections it could not make
        return failure.describe() + ": " + " | ".join(unreachable[:4])
    return failure.describe() + (": " + " | ".join(lines[-4:]) if lines else "")


PEER_MARKER = "NODECTL_PEER_UNREACHABLE"
