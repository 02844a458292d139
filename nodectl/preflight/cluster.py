"""Cluster checks: what must agree across nodes (torch, CUDA, NCCL, driver, Python; packages, kernel,
firmware, swap, CPU governor), one GPU model, one InfiniBand rate. Pure functions of every node's report."""
from __future__ import annotations

from typing import Any, Callable, Mapping

from nodectl.preflight.checks import check
from nodectl.probe_report import ProbeReport
from nodectl.preflight.network import ib_ports, ib_rate
from nodectl.preflight.verdict import FAIL, PASS, SKIP, WARN, CheckResult, result

Reports = Mapping[str, "ProbeReport | Mapping"]


def typed(reports: Reports) -> dict[str, ProbeReport]:
    """Every node's report, typed (parsed once: a ProbeReport is kept as it is)."""
    return {node: ProbeReport.of(report) for node, report in reports.items()}


def _version(report: ProbeReport, what: str) -> str:
    if what == "python":
        return ".".join((report.python.version or "?").split(".")[:2])
    value = report.gpus.driver if what == "driver" else getattr(report.torch, what)
    return "-" if value is None else str(value)


@check("same torch/python/packages", "cluster", scope="cluster",
       doc=(("same torch / python",
            "the reports of every node",
            "fail on any difference, naming the odd node(s) and each side's version",
            "one version everywhere"),
           ("same packages",
            "installed distributions",
            "warn on differences, naming for each (up to four) the odd node(s) and the versions on each side "
            "(`transformers 4.57.1 on node1; 5.24.0 on the other 31`)",
            "a 32-node table must point at the node to fix")))
def check_versions(reports: Reports) -> list[CheckResult]:
    """torch and Python minor must agree (fail); other packages should (warn)."""
    reports = typed(reports)
    return _same(reports, ("version", "python")) + [check_packages(reports)]


@check("same cuda/nccl/driver", "cluster", scope="cluster", cuda_only=True,
       doc=(("same cuda / nccl / driver (GPU nodes)",
            "the reports of the GPU nodes",
            "fail on any difference, naming the odd node(s) and each side's version",
            "one version everywhere; gloo on CPU nodes uses no CUDA, NCCL or driver"),))
def check_gpu_stack(reports: Reports) -> list[CheckResult]:
    """CUDA, NCCL and the driver must agree across GPU nodes (CPU nodes and gloo use none of them)."""
    return _same(typed(reports), ("cuda", "nccl", "driver"))


def _same(reports: Mapping[str, ProbeReport], which: tuple[str, ...]) -> list[CheckResult]:
    results = []
    for what in which:
        label = {"version": "torch"}.get(what, what)
        versions = {node: _version(report, what) for node, report in reports.items()}
        if len(set(versions.values())) > 1:
            results.append(CheckResult(f"same {label}", "cluster", FAIL, _spread(versions),
                                       f"install one {label} version everywhere (nodectl env-dump --diff shows all "
                                       f"drift)"))
        else:
            results.append(CheckResult(f"same {label}", "cluster", PASS, next(iter(versions.values()), "-")))
    return results


def _facts_by_node(reports: Mapping[str, ProbeReport], read: Callable[[ProbeReport], Any]) -> dict[str, str]:
    """One fact per node (a string; lists joined), for the nodes whose report has it."""
    out = {}
    for node, report in reports.items():
        value = read(report)
        if isinstance(value, (list, tuple, set)):
            value = ",".join(sorted({str(v) for v in value if v})) or None
        if value not in (None, ""):
            out[node] = str(value)
    return out


def _spread(facts: Mapping[str, str]) -> str:
    """Each value with its nodes, the odd ones first and named; the most common value's nodes, when there are
    more than three, as "the other N": a 32-node table points at the one node to fix."""
    groups: dict[str, list[str]] = {}
    for node, value in facts.items():
        groups.setdefault(value, []).append(node)
    ordered = sorted(groups.items(), key=lambda item: (len(item[1]), item[0]))
    parts = [f"{value} on {', '.join(nodes)}" for value, nodes in ordered[:-1]]
    value, nodes = ordered[-1]
    parts.append(f"{value} on {'the other ' + str(len(nodes)) if len(nodes) > 3 and parts else ', '.join(nodes)}")
    return "; ".join(parts)


UNIFORM_FACTS = (
    # (check, how to read it from a report, hint) -- differences warn: they explain one node running slower or
    # failing differently, and vendors qualify firmware and drivers as a set
    ("same kernel", lambda r: r.os.kernel, "one kernel build everywhere (uname -r)"),
    ("same vbios", lambda r: [d.vbios for d in r.gpus.devices],
     "flash one VBIOS version on every GPU (nvidia-smi -q | grep VBIOS)"),
    ("same hca firmware", lambda r: [d.fw_ver for d in r.infiniband],
     "update every HCA to one firmware (mlxfwmanager / ibv_devinfo shows fw_ver)"),
    ("same ofed", lambda r: [d.driver_version for d in r.infiniband],
     "install one MLNX_OFED / rdma-core version everywhere (ofed_info -s)"),
    ("same swap", lambda r: None if r.memory.swap_total_bytes is None else
     ("on" if r.memory.swap_total_bytes else "off"),
     "swap on some nodes only: a node that pages runs every rank at its pace; swapoff -a (and /etc/fstab)"),
)


@check("same kernel/vbios/hca firmware/ofed/swap, cpu governor", "cluster", scope="cluster",
       doc=(("same kernel / vbios / hca firmware / ofed",
            "`uname -r`; NVML VBIOS per GPU; `/sys/class/infiniband/*/fw_ver`; `/sys/module/mlx5_core/version`",
            "warn on differences, naming each value's nodes; skip when no node reports it",
            "vendors qualify driver, firmware and kernel as a set; a lone odd node is the usual straggler"),
           ("same swap",
            "`SwapTotal` in `/proc/meminfo`",
            "warn when swap is on for some nodes only",
            "a paging node sets every rank's pace"),
           ("cpu governor",
            "`/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor`",
            "warn when any node is not `performance` or nodes differ; skip without cpufreq (VMs, containers)",
            "data loading and launch overheads scale with clock")))
def check_uniformity(reports: Reports) -> list[CheckResult]:
    """Facts that should agree across nodes (warn when they differ; skip when no node could read them), and the
    CPU frequency governor, which should also be `performance` (powersave slows the data path and launches)."""
    reports, results = typed(reports), []
    for name, read, hint in UNIFORM_FACTS:
        facts = _facts_by_node(reports, read)
        if not facts:
            results.append(CheckResult(name, "cluster", SKIP, "no node reported it"))
        elif len(set(facts.values())) > 1:
            results.append(CheckResult(name, "cluster", WARN, _spread(facts), hint))
        else:
            results.append(CheckResult(name, "cluster", PASS, next(iter(facts.values()))))
    governors = _facts_by_node(reports, lambda r: r.cpu.governor)
    slow = {node: g for node, g in governors.items() if g != "performance"}
    if not governors:
        results.append(CheckResult("cpu governor", "cluster", SKIP, "no node exposes cpufreq (a VM or container?)"))
    elif slow or len(set(governors.values())) > 1:
        results.append(CheckResult("cpu governor", "cluster", WARN, _spread(governors),
                                   "cpupower frequency-set -g performance on every node (or the BIOS power "
                                   "profile 'maximum performance')"))
    else:
        results.append(CheckResult("cpu governor", "cluster", PASS, "performance"))
    return results


DISTRIBUTED_ENV = ("NCCL_", "TORCH_", "GLOO_", "NVSHMEM_", "UCX_", "FI_", "CUDA_DEVICE_MAX_CONNECTIONS",
                   "CUDA_LAUNCH_BLOCKING", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


@check("same NCCL/torch env", "cluster", scope="cluster",
       doc=(("same NCCL/torch env",
            "`NCCL_*`, `TORCH_*`, `GLOO_*`, `NVSHMEM_*`, `UCX_*`, `FI_*`, `PYTORCH_CUDA_ALLOC_CONF`, "
            "`CUDA_DEVICE_MAX_CONNECTIONS`, `CUDA_LAUNCH_BLOCKING` in the environment each node's ranks get: its "
            "login environment with its inventory `env:` laid over (the probe runs under it; values travel in its "
            "source, never on a command line)",
            "warn when a variable is set differently (or only on some nodes), naming the variable, the nodes and "
            "both values",
            "an `NCCL_SOCKET_IFNAME` in one node's ~/.bashrc: the ranks disagree and nothing says why; the "
            "inventory's `env:` sets them alike"),))
def check_distributed_env(reports: Reports) -> CheckResult:
    """Variables that change how ranks talk or allocate, set in one node's login environment and not another's
    (an NCCL_SOCKET_IFNAME in one ~/.bashrc): the ranks then disagree, and nothing says why. The inventory's env:
    sets them for every node alike, over the login environment."""
    envs = {node: {k: v for k, v in r.env.items() if isinstance(k, str) and k.startswith(DISTRIBUTED_ENV)}
            for node, r in typed(reports).items() if r.env is not None}
    if not envs:
        return result("cluster", SKIP, "no node reported its environment")
    names = sorted(set().union(*(e.keys() for e in envs.values())))
    differing = [name for name in names if len({str(e.get(name)) for e in envs.values()}) > 1]
    if not differing:
        return result("cluster", PASS,
                      f"{len(names)} such variable(s), the same everywhere" if names else "none set")
    shown = []
    for name in differing[:3]:
        spread = {node: (e[name] if name in e else "unset") for node, e in envs.items()}
        shown.append(f"{name}: {_spread(spread)}")
    more = f" (and {len(differing) - 3} more)" if len(differing) > 3 else ""
    return result("cluster", WARN, " | ".join(shown) + more,
                  "set them once for every node in the inventory's env: (defaults:), or remove them from "
                  "the nodes' shell start-up files and from the env: of the node that differs in hosts.yaml")


IGNORED_PACKAGES = {"pip", "setuptools", "wheel", "nodectl"}


def check_packages(reports: Reports) -> CheckResult:
    packages = {node: r.packages for node, r in typed(reports).items()}
    names = set().union(*(p.keys() for p in packages.values())) - IGNORED_PACKAGES if packages else set()
    differing = sorted(n for n in names if len({p.get(n, "-") for p in packages.values()}) > 1)
    if differing:
        shown = [f"{name} {_spread({node: p.get(name, 'missing') for node, p in packages.items()})}"
                 for name in differing[:4]]
        more = f" (and {len(differing) - 4} more: {', '.join(differing[4:10])})" if len(differing) > 4 else ""
        return CheckResult("same packages", "cluster", WARN, f"{len(differing)} differ: " + " | ".join(shown) + more,
                           "install the same versions on every node (nodectl env-dump --diff lists them all)")
    return CheckResult("same packages", "cluster", PASS, f"{len(names)} packages agree")


@check("one GPU model", "cluster", scope="cluster", cuda_only=True,
       doc=(("one GPU model",
            "models per node",
            "fail on more than one across the cluster",
            "a run is as fast as its slowest GPU"),))
def check_gpu_models(reports: Reports) -> CheckResult:
    models = {node: sorted({d.name for d in r.gpus.devices if d.name is not None})
              for node, r in typed(reports).items()}
    distinct = {tuple(m) for m in models.values() if m}
    if len(distinct) > 1:
        return result("cluster", FAIL,
                      "; ".join(f"{node}: {', '.join(m)}" for node, m in models.items()),
                      "a run is as fast as its slowest GPU; exclude the odd nodes with --exclude")
    return result("cluster", PASS, ", ".join(next(iter(distinct), ("none",))))


@check("ib rate", "cluster", scope="cluster", cuda_only=True,
       doc=(("ib rate (cluster)",
            "every active port's rate",
            "warn on a port below the fastest of its link layer in the cluster, naming node and port",
            "a downtrained cable or transceiver sets the pace of collectives through it"),))
def check_ib_rates(reports: Reports) -> CheckResult:
    """Every active port's rate against the fastest active port of its link layer in the cluster: a port that came
    up at a lower rate (a bad cable or transceiver) sets the pace of every collective through it."""
    rates = {}
    for node, report in typed(reports).items():
        for device, port in ib_ports(report):
            rate = ib_rate(port)
            if rate and "ACTIVE" in (port.state or ""):
                rates[(node, f"{device.name}/{port.port}")] = (port.link_layer or "?", rate)
    if not rates:
        return result("cluster", SKIP, "no active InfiniBand/RoCE port")
    fastest = {}
    for layer, rate in rates.values():
        fastest[layer] = max(fastest.get(layer, 0), rate)
    slow = [f"{node} {port} {rate:g} Gb/s" for (node, port), (layer, rate) in rates.items() if rate < fastest[layer]]
    if slow:
        return result("cluster", WARN, "ports below the fastest of their kind ("
                      + ", ".join(f"{layer} {rate:g} Gb/s" for layer, rate in fastest.items()) + "): "
                      + "; ".join(slow[:8]),
                      "ibstat on those nodes; reseat or replace the cable or transceiver, or leave the port "
                      "out with NCCL_IB_HCA if it is not meant for training")
    return result("cluster", PASS, ", ".join(f"{len(rates)} port(s) at {layer} {rate:g} Gb/s"
                                              for layer, rate in fastest.items()))
