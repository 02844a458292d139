"""The collective test: a short torchrun job through the launch pipeline (nodectl/launch/: its stages PLAN to
ATTEND, in the preflight's session), and what its logs say of NCCL's transports. Parsing is pure and unit-tested
on saved log lines."""
from __future__ import annotations

import tempfile
from dataclasses import replace

from nodectl.inventory import Inventory
from nodectl.launch.attending import Attending
from nodectl.launch import LaunchRequest, Stage, launch
from nodectl.launch.job import JobSpec, StartFailed
from nodectl.preflight.checks import Tier
from nodectl.probe_report import ProbeReport
from nodectl.preflight.network import address_owners, judge_collective, judge_pairs, result_in, transports_in
from nodectl.remote import sync
from nodectl.remote.answers import NO_LOG
from nodectl.transport import Cluster, Session
from nodectl.watch import tail_lines

STAGES = (Stage.PLAN, Stage.SETTLE, Stage.RECORD, Stage.START, Stage.ATTEND)

GPU_MAX, GPU_FULL_MAX, CPU_MAX = 1 << 30, 4 << 30, 64 << 20  # the all-reduce's largest message


PAIR_GPU_MAX, PAIR_CPU_MAX = 256 << 20, 16 << 20
DEFAULT_DEADLINE_S = 120  # per peer connection and per collective; torch's own: 10 min (NCCL), 30 min (gloo)


def run_pairs(inventory: Inventory, session: Session, *, gpus: int | None, deadline: float | None = None,
              facts: dict | None = None) -> list[dict]:
    """The collective on each ring neighbour pair (node i with node i+1), one pair at a time."""
    nodes, pairs = inventory.nodes, []
    for i in range(len(nodes)):
        pair = (nodes[i], nodes[(i + 1) % len(nodes)])
        sub = replace(inventory, nodes=tuple(replace(n, index=k) for k, n in enumerate(pair)))
        limit = PAIR_GPU_MAX if pair[0].device == "cuda" else PAIR_CPU_MAX
        # only the largest size: the pair's bandwidth is what finds a slow node, and each smaller size cost ~1 s
        result, _, failure, run_id = run_collective(sub, session, gpus=gpus, full=False, max_bytes=limit,
                                                    min_bytes=limit, deadline=deadline, facts=facts)
        entry = {"nodes": [n.name for n in pair], "run": run_id}
        if result and all(s["ok"] for s in result["sizes"]):
            entry["busbw_gbs"] = result["sizes"][-1]["busbw_gbs"]
        else:
            entry["error"] = failure or "wrong sums"
        pairs.append(entry)
    return pairs


def run_collective(inventory: Inventory, session: Session, *, gpus: int | None, full: bool, grace: float = 5.0,
                   max_bytes: int | None = None, min_bytes: int | None = None, deadline: float | None = None,
                   facts: dict | None = None) -> tuple[dict | None, dict[str, int], str | None, str]:
    """(result, transports, failure, run id) of the all-reduce job on every selected node and rank."""
    gpu_run = inventory.nodes[0].device == "cuda"
    max_bytes = max_bytes or ((GPU_FULL_MAX if full else GPU_MAX) if gpu_run else CPU_MAX)
    if gpu_run:  # NCCL says which transport each connection took
        inventory = replace(inventory, nodes=tuple(replace(n, env={"NCCL_DEBUG": "INFO", **n.env})
                                                   for n in inventory.nodes))
    with tempfile.TemporaryDirectory(prefix="nodectl-preflight-") as empty:  # the job's project: nothing to send
        sweep = ("--max-bytes", str(max_bytes), *(("--min-bytes", str(min_bytes)) if min_bytes else ()),
                 "--deadline-s", str(deadline or DEFAULT_DEADLINE_S))
        spec = JobSpec(inventory, command=("../lib/collective.py", *sweep), sync_dir=empty,
                       files=tuple(sync.nodectl_files(False, None, ("collective.py",))), gpus=gpus, facts=facts or {},
                       kind="preflight", argv=("nodectl", "preflight", "(collective test)"))
        try:
            outcome = launch(LaunchRequest(spec, Attending(grace=grace), skip_preflight=True), session, STAGES)
        except StartFailed as failed:
            return None, {}, str(failed.message), failed.run_id
        run_nodes, cluster = outcome.run.nodes(), session.cluster(inventory.nodes)
        logs = ""
        for run_node in run_nodes:
            logs += tail_lines(cluster, run_node, [run_node.ranks[0]], 5000).get(run_node.ranks[0], NO_LOG).text
        return result_in(logs), transports_in(logs), _failure_text(cluster, run_nodes, outcome.failure), outcome.job.run_id


def add_collectives(report, inventory: Inventory, session: Session, *, gpus: int | None, tier: Tier,
                    deadline: float | None, phase=lambda text: None) -> None:
    """The default and full tiers' jobs, after the probe's checks passed everywhere: the all-reduce over every
    node (and, with --full and over two nodes, each neighbour pair), judged into `report`."""
    full = tier is Tier.FULL
    if not tier.measured or report.quick or report.unreachable or report.failed:
        return
    reports = report.reports
    ib = any(r.infiniband or r.infiniband_error for r in map(ProbeReport.of, reports.values()))
    phase(f"all-reduce test on {len(inventory.nodes)} node(s)")
    result, transports, failure, run_id = run_collective(inventory, session, gpus=gpus, full=full,
                                                         deadline=deadline, facts=reports)
    owners = address_owners(inventory.nodes, {name: ProbeReport.of(r) for name, r in reports.items()})
    report.results += judge_collective(result, transports, ib, len(inventory.nodes), failure, run_id, owners)
    report.collective, report.collective_run = result, run_id
    if transports:
        report.collective = {**(result or {}), "transports": transports}
    if full and len(inventory.nodes) > 2:
        phase("node-pair bandwidth tests")
        pairs = run_pairs(inventory, session, gpus=gpus, deadline=deadline, facts=reports)
        report.results += judge_pairs(pairs)
        report.collective = {**(report.collective or {}), "pairs": pairs}


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
