"""The judge: which checks run for a node and for the cluster, at which tier, and their verdicts.

Each check is a pure function of facts gathered elsewhere (preflight/run.py); this table says, per check, its
subject (host, gpu, network, cluster), the devices it applies to and the tiers it runs at. `checks_for` lists
them, so what a tier checks is read in one place (docs/PREFLIGHT.md describes each).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from nodectl.preflight import cluster, gpu, host, network
from nodectl.preflight.verdict import CheckResult

TIERS = ("quick", "default", "full")
MEASURED = ("default", "full")     # tiers that run the GPU job and the all-reduce job


@dataclass(frozen=True)
class Expectation:
    """What the launch will ask of the nodes."""

    gpus: int | None          # ranks per node on cuda nodes (None: whatever each node has)
    master_port: int | None
    master_addr: str


@dataclass(frozen=True)
class NodeFacts:
    """What the checks of one node read: its probe report and the answers gathered for it."""

    node: str
    report: Mapping
    device: str
    expect: Expectation
    extras: Mapping = field(default_factory=dict)   # p2p (the GPU job), port, reach and route answers
    env: Mapping[str, str] = field(default_factory=dict)   # what the inventory sets for the node's ranks
    gpus: int | None = None                          # the node's `gpus:`
    medians: Mapping = field(default_factory=dict)   # per GPU model, the cluster's median GPU job figures


@dataclass(frozen=True)
class Check:
    name: str
    subject: str
    judge: Callable[[NodeFacts], CheckResult | list[CheckResult]]
    cuda_only: bool = False
    tiers: tuple[str, ...] = TIERS
    needs: str | None = None    # an answer in NodeFacts.extras without which the check does not run


NODE_CHECKS = (
    Check("container", "host", lambda f: host.check_container(f.node, f.report)),
    Check("environment", "host", lambda f: host.check_environment(f.node, f.report)),
    Check("torch", "host", lambda f: host.check_torch(f.node, f.report, f.device)),
    Check("gpus", "gpu", lambda f: gpu.check_gpu_count(f.node, f.report, f.expect.gpus, f.gpus), cuda_only=True),
    Check("gpu idle", "gpu", lambda f: gpu.check_gpus_idle(f.node, f.report), cuda_only=True),
    Check("ecc", "gpu", lambda f: gpu.check_ecc(f.node, f.report), cuda_only=True),
    Check("persistence", "gpu", lambda f: gpu.check_persistence(f.node, f.report), cuda_only=True),
    Check("p2p", "gpu", lambda f: gpu.check_p2p(f.node, f.extras.get("p2p")), cuda_only=True, tiers=MEASURED),
    Check("nvlink", "gpu", lambda f: gpu.check_nvlink(f.node, f.report), cuda_only=True),
    Check("infiniband", "network", lambda f: network.check_infiniband(f.node, f.report), cuda_only=True),
    Check("memlock", "host", lambda f: host.check_memlock(f.node, f.report), cuda_only=True),
    Check("pcie link", "gpu", lambda f: gpu.check_pcie_link(f.node, f.report), cuda_only=True),
    Check("thermal", "gpu", lambda f: gpu.check_thermal(f.node, f.report), cuda_only=True),
    Check("mig", "gpu", lambda f: gpu.check_mig_compute_mode(f.node, f.report), cuda_only=True),
    Check("fabric manager", "gpu", lambda f: gpu.check_fabric(f.node, f.report), cuda_only=True),
    Check("nvlink errors", "gpu", lambda f: gpu.check_nvlink_errors(f.node, f.report), cuda_only=True),
    Check("xid", "gpu", lambda f: gpu.check_xid(f.node, f.report), cuda_only=True),
    Check("ib errors", "network", lambda f: network.check_ib_errors(f.node, f.report), cuda_only=True),
    Check("gpudirect", "gpu", lambda f: gpu.check_gpudirect(f.node, f.report), cuda_only=True),
    Check("numa", "gpu", lambda f: gpu.check_numa(f.node, f.report), cuda_only=True),
    Check("ib hca", "network", lambda f: network.check_ib_hca(f.node, f.report, f.env), cuda_only=True),
    Check("workdir", "host", lambda f: host.check_workdir(f.node, f.report)),
    Check("shm", "host", lambda f: host.check_shm(f.node, f.report)),
    Check("disk", "host", lambda f: host.check_disk(f.node, f.report)),
    Check("clock", "host", lambda f: host.check_clock(f.node, f.report)),
    Check("nofile", "host", lambda f: host.check_nofile(f.node, f.report)),
    Check("processes", "host", lambda f: host.check_processes(f.node, f.report)),
    Check("cgroup limits", "host", lambda f: host.check_cgroup(f.node, f.report, f.expect.gpus or f.gpus or 1)),
    Check("tmp, cache", "host", lambda f: host.check_scratch(f.node, f.report)),
    Check("socket ifname", "network", lambda f: network.check_socket_ifname(f.node, f.report, f.env)),
    Check("master port", "network", lambda f: network.check_master_port(f.node, f.extras["port"]), needs="port"),
    Check("reach master", "network",
          lambda f: network.check_reach_master(f.node, f.extras["reach"], f"{f.expect.master_addr}:"
                                                                         f"{f.expect.master_port}"), needs="reach"),
    Check("interface", "network", lambda f: network.check_route(f.node, f.extras["route"], f.expect.master_addr),
          needs="route"),
    Check("gpu perf, gpu load", "gpu", lambda f: gpu.check_gpu_perf(f.node, f.extras.get("p2p"), f.medians),
          cuda_only=True, tiers=MEASURED),
)

# Across nodes; the all-reduce job (default and full) and the node-pair tests (full, more than 2 nodes) are judged
# by network.judge_collective and network.judge_pairs once those jobs have run.
CLUSTER_CHECKS = (
    Check("same torch/python/packages", "cluster", lambda r: cluster.check_versions(r)),
    Check("same cuda/nccl/driver", "cluster", lambda r: cluster.check_gpu_stack(r), cuda_only=True),
    Check("same kernel/vbios/hca firmware/ofed/swap, cpu governor", "cluster", lambda r: cluster.check_uniformity(r)),
    Check("same NCCL/torch env", "cluster", lambda r: cluster.check_distributed_env(r)),
    Check("one GPU model", "cluster", lambda r: cluster.check_gpu_models(r), cuda_only=True),
    Check("ib rate", "cluster", lambda r: cluster.check_ib_rates(r), cuda_only=True),
    Check("collective, nccl transport", "network", lambda r: [], tiers=MEASURED),
    Check("node pairs", "network", lambda r: [], tiers=("full",)),
)


def checks_for(tier: str, device: str = "cuda") -> list[Check]:
    """The checks a preflight of this tier runs on a node of this device, then across the cluster."""
    return [c for c in NODE_CHECKS + CLUSTER_CHECKS
            if tier in c.tiers and (device == "cuda" or not c.cuda_only)]


def _flat(verdicts: CheckResult | list[CheckResult]) -> list[CheckResult]:
    return verdicts if isinstance(verdicts, list) else [verdicts]


def judge_node(facts: NodeFacts, tier: str = "default") -> list[CheckResult]:
    """Every check of one node at this tier."""
    out: list[CheckResult] = []
    for check in NODE_CHECKS:
        if tier not in check.tiers or (check.cuda_only and facts.device != "cuda"):
            continue
        if check.needs and check.needs not in facts.extras:
            continue
        out += _flat(check.judge(facts))
    return out


def judge_cluster(reports: Mapping[str, Mapping], devices: Mapping[str, str],
                  tier: str = "default") -> list[CheckResult]:
    """The cross-node checks over every reachable node's report."""
    cuda = any(d == "cuda" for d in devices.values())
    out: list[CheckResult] = []
    for check in CLUSTER_CHECKS:
        if tier in check.tiers and (cuda or not check.cuda_only):
            out += _flat(check.judge(reports))
    return out
