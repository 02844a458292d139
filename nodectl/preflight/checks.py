"""Preflight checks: small pure units that judge probe reports. Probing (remote, slow) happens elsewhere; every
function here reads only the reports it is given, so each is unit-tested on saved or crafted reports."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from nodectl.preflight.health import check_ib_rates
from nodectl.preflight.verdict import FAIL, PASS, SKIP, WARN, CheckResult, get, skip_if_unreadable, unreadable

SHM_MIN = 1 << 30
DISK_WARN, DISK_FAIL = 20 << 30, 2 << 30
GPU_BUSY_BYTES = 1 << 30
SKEW_WARN, SKEW_FAIL = 1.0, 30.0
NOFILE_FAIL, NOFILE_WARN = 1024, 65536
SOCKET_IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
VIRTUAL_PREFIXES = ("docker", "veth", "virbr", "br-", "lo", "cni", "flannel", "cali", "tun", "tap")


@dataclass(frozen=True)
class Expectation:
    """What the launch will ask of the nodes."""

    gpus: int | None          # ranks per node on cuda nodes (None: whatever each node has)
    master_port: int | None
    master_addr: str


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_torch(node: str, report: Mapping, device: str) -> CheckResult:
    torch = report.get("torch") or {}
    python = get(report, "python", "executable", default="python3")
    if "error" in torch:
        return CheckResult("torch", node, FAIL, f"torch does not import for {python}: {torch['error']}",
                           f"install it into that interpreter: {python} -m pip install torch (the CUDA build "
                           f"your driver supports), or set python: in hosts.yaml to one that has it")
    if device == "cuda" and torch.get("imported") and not torch.get("cuda_available"):
        return CheckResult("torch", node, FAIL, f"torch {torch.get('version')} sees no CUDA device",
                           "install a CUDA build of torch (not +cpu), check the driver with nvidia-smi, or use "
                           "device: cpu for this node")
    return CheckResult("torch", node, PASS, f"torch {torch.get('version')} (CUDA {torch.get('cuda') or '-'}, "
                                            f"NCCL {torch.get('nccl') or '-'})")


@skip_if_unreadable("gpus", "gpus")
def check_gpu_count(node: str, report: Mapping, want: int | None, inventory_gpus: int | None = None) -> CheckResult:
    """The GPUs the ranks will see (CUDA_VISIBLE_DEVICES applied by the probe) against what the launch asks:
    --gpus, else the node's `gpus:`; a CUDA_VISIBLE_DEVICES entry that names no GPU of the node fails."""
    count = get(report, "gpus", "count", default=0)
    if not get(report, "gpus", "available", default=False):
        return CheckResult("gpus", node, FAIL, f"no GPU visible: {get(report, 'gpus', 'reason', default='?')}",
                           "install the NVIDIA driver and nvidia-ml-py on the node, or use device: cpu")
    unresolved = get(report, "gpus", "unresolved", default=[])
    if unresolved:
        total = get(report, "gpus", "count_all", default="?")
        return CheckResult("gpus", node, FAIL,
                           f"CUDA_VISIBLE_DEVICES={get(report, 'gpus', 'visible')} names {unresolved[0]!r}, which is "
                           f"no GPU of this node (it has {total}: indexes 0-{total - 1 if isinstance(total, int) else '?'}"
                           f" or GPU-<uuid>); CUDA ignores it and every entry after it",
                           "fix CUDA_VISIBLE_DEVICES in this node's env: (nvidia-smi -L lists the GPUs)")
    asked, source = (want, "--gpus") if want else (inventory_gpus, "gpus: in hosts.yaml")
    if asked and count < asked:
        visible = " visible" if get(report, "gpus", "visible") is not None else ""
        return CheckResult("gpus", node, FAIL, f"{count}{visible} GPU(s), {asked} asked by {source}",
                           f"lower {source} to {count} for this node, or make more GPUs visible to it")
    models = {d["name"] for d in get(report, "gpus", "devices", default=[])}
    if len(models) > 1:
        return CheckResult("gpus", node, FAIL, f"mixed GPU models on one node: {', '.join(sorted(models))}",
                           "set CUDA_VISIBLE_DEVICES in this node's env: to GPUs of one model")
    return CheckResult("gpus", node, PASS, f"{count}x {next(iter(models), '?')}")


@skip_if_unreadable("gpu idle", "gpus")
def check_gpus_idle(node: str, report: Mapping, own_pids: frozenset[int] = frozenset()) -> CheckResult:
    busy, notes = [], []
    for device in get(report, "gpus", "devices", default=[]):
        for proc in device.get("compute_processes", []):
            if proc.get("pid") not in own_pids:
                busy.append(f"GPU{device['index']}: pid {proc['pid']} ({proc.get('user', '?')})")
        used = device.get("memory_used_bytes") or 0
        if used > GPU_BUSY_BYTES:
            notes.append(f"GPU{device['index']} has {_gib(used)} in use")
    if busy:
        return CheckResult("gpu idle", node, FAIL, "; ".join(busy),
                           "stop those processes (a stray rank of an earlier run? `nodectl stop --run RUN`), "
                           "or leave those GPUs out with CUDA_VISIBLE_DEVICES")
    if notes:
        return CheckResult("gpu idle", node, FAIL, "; ".join(notes),
                           "memory is held with no compute process listed: another container or a zombie; "
                           "check nvidia-smi on the node")
    return CheckResult("gpu idle", node, PASS, "no foreign compute process")


@skip_if_unreadable("ecc", "gpus")
def check_ecc(node: str, report: Mapping) -> CheckResult:
    bad = []
    for d in get(report, "gpus", "devices", default=[]):
        if (d.get("ecc_volatile_uncorrected") or 0) > 0:
            bad.append(f"GPU{d['index']}: {d['ecc_volatile_uncorrected']} uncorrectable ECC errors")
        if d.get("retired_pages_pending"):
            bad.append(f"GPU{d['index']}: retired pages pending")
        if d.get("remapped_rows_pending") or d.get("remapped_rows_failed"):
            bad.append(f"GPU{d['index']}: row remapping {'failed' if d.get('remapped_rows_failed') else 'pending'}")
    if bad:
        return CheckResult("ecc", node, FAIL, "; ".join(bad),
                           "reset the GPU when idle (pending retirements/remaps apply at reset) or drain the node")
    return CheckResult("ecc", node, PASS, "no uncorrectable errors or pending retirements")


@skip_if_unreadable("persistence", "gpus")
def check_persistence(node: str, report: Mapping) -> CheckResult:
    off = [str(d["index"]) for d in get(report, "gpus", "devices", default=[]) if not d.get("persistence_mode")]
    if off:
        return CheckResult("persistence", node, WARN, f"persistence mode off on GPU {','.join(off)}",
                           "sudo nvidia-smi -pm 1 (or enable nvidia-persistenced) to avoid slow first CUDA calls")
    return CheckResult("persistence", node, PASS, "on")


def check_p2p(node: str, p2p: Mapping | None) -> CheckResult:
    if not p2p:
        return CheckResult("p2p", node, SKIP, "not measured (--quick)")
    if "error" in p2p:
        return CheckResult("p2p", node, FAIL, f"P2P test failed: {p2p['error']}",
                           "NCCL_P2P_DISABLE=1 for this node; check ACS/IOMMU settings in BIOS and kernel",
                           {"NCCL_P2P_DISABLE": "1"})
    broken = [f"{p['src']}->{p['dst']}: {p.get('error') or 'wrong data'}" for p in p2p.get("pairs", [])
              if not p.get("ok")]
    if broken:
        return CheckResult("p2p", node, FAIL, "; ".join(broken[:4]),
                           "GPU peer copies fail or corrupt data: set NCCL_P2P_DISABLE=1 for this node; usually "
                           "PCIe ACS or the IOMMU blocks peer traffic (disable ACS, or iommu=pt)",
                           {"NCCL_P2P_DISABLE": "1"})
    pairs = p2p.get("pairs", [])
    if not pairs:
        return CheckResult("p2p", node, SKIP, "fewer than 2 GPUs")
    slowest = min((p["gbps"] for p in pairs), default=0)
    peer = sum(1 for p in pairs if p.get("peer_access"))
    return CheckResult("p2p", node, PASS, f"{len(pairs)} pairs correct, {peer} with peer access, "
                                          f"slowest {slowest:.0f} GB/s")


@skip_if_unreadable("nvlink", "gpus")
def check_nvlink(node: str, report: Mapping) -> CheckResult:
    devices = get(report, "gpus", "devices", default=[])
    if len(devices) < 2:
        return CheckResult("nvlink", node, SKIP, "fewer than 2 GPUs")
    active = [d.get("nvlinks_active", 0) for d in devices]
    if not any(active):
        return CheckResult("nvlink", node, PASS, "no NVLink (PCIe only)")
    if not all(active):
        on_pcie = [str(d["index"]) for d in devices if not d.get("nvlinks_active")]
        return CheckResult("nvlink", node, WARN, f"GPU {','.join(on_pcie)} without active NVLink while others "
                                                 f"have it", "a link is down: check nvidia-smi nvlink -s")
    return CheckResult("nvlink", node, PASS, f"{min(active)}-{max(active)} active links per GPU")


def check_infiniband(node: str, report: Mapping) -> CheckResult:
    devices = report.get("infiniband") or []
    if isinstance(devices, Mapping):  # {"error": ...}: the devices could not be listed
        return CheckResult("infiniband", node, SKIP, f"InfiniBand devices could not be read ({devices.get('error')})")
    if not devices:
        return CheckResult("infiniband", node, SKIP, "no InfiniBand/RoCE device")
    ports = [(d["name"], p) for d in devices for p in d.get("ports", [])]
    down = [f"{name}/{p['port']} {p.get('state')} {p.get('phys_state')}" for name, p in ports
            if "ACTIVE" not in (p.get("state") or "") or "LinkUp" not in (p.get("phys_state") or "")]
    if down:
        return CheckResult("infiniband", node, FAIL, "ports not ACTIVE/LinkUp: " + "; ".join(down),
                           "check cables and the subnet manager (ibstat; systemctl status opensm); list only "
                           "working HCAs with NCCL_IB_HCA")
    rates = sorted({p.get("rate") for _, p in ports})
    layers = sorted({p.get("link_layer") for _, p in ports})
    return CheckResult("infiniband", node, PASS, f"{len(ports)} port(s) up, {', '.join(map(str, rates))}, "
                                                 f"{'/'.join(map(str, layers))}")


@skip_if_unreadable("memlock", "limits")
def check_memlock(node: str, report: Mapping) -> CheckResult:
    soft = get(report, "limits", "memlock_soft")
    if not report.get("infiniband"):
        return CheckResult("memlock", node, SKIP if soft != "unlimited" else PASS,
                           f"memlock {soft} (only matters with InfiniBand)")
    if soft != "unlimited":
        return CheckResult("memlock", node, FAIL, f"memlock is {soft} bytes with InfiniBand present",
                           "add '* soft memlock unlimited' and '* hard memlock unlimited' to "
                           "/etc/security/limits.conf (LimitMEMLOCK=infinity for services), then log in again")
    return CheckResult("memlock", node, PASS, "unlimited")


@skip_if_unreadable("nofile", "limits")
def check_nofile(node: str, report: Mapping) -> CheckResult:
    """Open files: every rank holds sockets to its peers (NCCL, gloo, the TCP store), data loader workers share
    tensors through descriptors; 1024 is soon spent at scale, a few hundred at once."""
    soft, hard = get(report, "limits", "nofile_soft"), get(report, "limits", "nofile_hard")
    if soft is None:
        return CheckResult("nofile", node, SKIP, "the probe did not read the open-files limit")
    fix = ("add '* soft nofile 1048576' and '* hard nofile 1048576' to /etc/security/limits.conf "
           "(LimitNOFILE=1048576 for services), then log in again")
    if soft != "unlimited" and soft < NOFILE_FAIL:
        return CheckResult("nofile", node, FAIL, f"open files limited to {soft} (hard {hard})", fix)
    if soft != "unlimited" and soft < NOFILE_WARN:
        return CheckResult("nofile", node, WARN, f"open files limited to {soft} (hard {hard})", fix)
    return CheckResult("nofile", node, PASS, f"{soft} open files")


def _named_interfaces(value: str, names: list[str]) -> tuple[list[str], list[str]]:
    """What NCCL's (and gloo's) *_SOCKET_IFNAME value selects among `names`, and the parts that select nothing:
    a comma list of prefixes, `=name` for an exact name, a leading `^` to exclude (judged as always matching)."""
    value = value.strip()
    if value.startswith("^"):
        return [n for n in names if not any(n.startswith(p.lstrip("=")) for p in value[1:].split(",") if p)], []
    exact = value.startswith("=")
    parts = [p for p in value.lstrip("=").split(",") if p]
    chosen, missing = [], []
    for part in parts:
        hits = [n for n in names if (n == part if exact else n.startswith(part))]
        chosen += hits
        if not hits:
            missing.append(part)
    return chosen, missing


def check_socket_ifname(node: str, report: Mapping, env: Mapping[str, str]) -> CheckResult:
    """NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME from the inventory's env must name an interface the node has, and
    it must be up: a wrong name makes NCCL fail at init ("no socket interface found") and gloo hang or fail."""
    named = {var: env[var] for var in SOCKET_IFNAME_VARS if env.get(var)}
    if not named:
        return CheckResult("socket ifname", node, PASS, "not set (NCCL and gloo choose)")
    reason = unreadable(report, "nics")
    if reason:
        return CheckResult("socket ifname", node, SKIP, reason)
    nics = {n.get("name"): n for n in report.get("nics") or [] if n.get("name")}
    up = sorted(name for name, nic in nics.items() if nic.get("state") in ("up", "unknown"))
    problems = []
    for var, value in named.items():
        chosen, missing = _named_interfaces(value, list(nics))
        if missing:
            problems.append(f"{var}={value}: no interface {', '.join(missing)} on the node")
        elif not [n for n in chosen if n in up]:
            problems.append(f"{var}={value}: {', '.join(chosen)} is down")
    if problems:
        return CheckResult("socket ifname", node, FAIL, "; ".join(problems),
                           f"set it in the inventory's env: to an interface that is up there: {', '.join(up)}")
    return CheckResult("socket ifname", node, PASS, ", ".join(f"{var}={value}" for var, value in named.items()))


@skip_if_unreadable("shm", "disk")
def check_shm(node: str, report: Mapping) -> CheckResult:
    shm = get(report, "disk", "shm_bytes")
    if shm is None:
        return CheckResult("shm", node, FAIL, "/dev/shm is missing", "mount a tmpfs on /dev/shm")
    if shm < SHM_MIN:
        return CheckResult("shm", node, FAIL, f"/dev/shm is {_gib(shm)}",
                           "at least 1 GiB: in docker use --shm-size=16g or --ipc=host; else "
                           "mount -o remount,size=16G /dev/shm")
    return CheckResult("shm", node, PASS, _gib(shm))


@skip_if_unreadable("disk", "disk")
def check_disk(node: str, report: Mapping) -> CheckResult:
    free = get(report, "disk", "free_bytes")
    where = get(report, "disk", "workdir", default="workdir")
    if free is None:
        return CheckResult("disk", node, SKIP, "free space could not be read")
    if free < DISK_FAIL:
        return CheckResult("disk", node, FAIL, f"{_gib(free)} free in {where}", "free space or move workdir:")
    if free < DISK_WARN:
        return CheckResult("disk", node, WARN, f"{_gib(free)} free in {where}", "checkpoints may not fit")
    return CheckResult("disk", node, PASS, f"{_gib(free)} free")


def _version(report: Mapping, what: str) -> str:
    if what == "python":
        return ".".join(str(get(report, "python", "version", default="?")).split(".")[:2])
    if what == "driver":
        return str(get(report, "gpus", "driver", default="-"))
    return str(get(report, "torch", what, default="-"))


def check_versions(reports: Mapping[str, Mapping]) -> list[CheckResult]:
    """torch, CUDA, NCCL, driver and Python minor must agree (fail); other packages should (warn)."""
    results = []
    for what in ("version", "cuda", "nccl", "driver", "python"):
        label = {"version": "torch"}.get(what, what)
        versions = {node: _version(report, what) for node, report in reports.items()}
        if len(set(versions.values())) > 1:
            results.append(CheckResult(f"same {label}", "cluster", FAIL, _spread(versions),
                                       f"install one {label} version everywhere (nodectl env-dump --diff shows all "
                                       f"drift)"))
        else:
            results.append(CheckResult(f"same {label}", "cluster", PASS, next(iter(versions.values()), "-")))
    results.append(check_packages(reports))
    return results


def _facts_by_node(reports: Mapping[str, Mapping], read: Callable[[Mapping], Any]) -> dict[str, str]:
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
    groups: dict[str, list[str]] = {}
    for node, value in facts.items():
        groups.setdefault(value, []).append(node)
    return "; ".join(f"{value} on {', '.join(nodes)}" for value, nodes in sorted(groups.items()))


UNIFORM_FACTS = (
    # (check, how to read it from a report, hint) -- differences warn: they explain one node running slower or
    # failing differently, and vendors qualify firmware and drivers as a set
    ("same kernel", lambda r: get(r, "os", "kernel"), "one kernel build everywhere (uname -r)"),
    ("same vbios", lambda r: [d.get("vbios") for d in get(r, "gpus", "devices", default=[]) or []],
     "flash one VBIOS version on every GPU (nvidia-smi -q | grep VBIOS)"),
    ("same hca firmware", lambda r: [d.get("fw_ver") for d in r.get("infiniband") or [] if isinstance(d, Mapping)],
     "update every HCA to one firmware (mlxfwmanager / ibv_devinfo shows fw_ver)"),
    ("same ofed", lambda r: [d.get("driver_version") for d in r.get("infiniband") or [] if isinstance(d, Mapping)],
     "install one MLNX_OFED / rdma-core version everywhere (ofed_info -s)"),
    ("same swap", lambda r: None if get(r, "memory", "swap_total_bytes") is None else
     ("on" if get(r, "memory", "swap_total_bytes") else "off"),
     "swap on some nodes only: a node that pages runs every rank at its pace; swapoff -a (and /etc/fstab)"),
)


def check_uniformity(reports: Mapping[str, Mapping]) -> list[CheckResult]:
    """Facts that should agree across nodes (warn when they differ; skip when no node could read them), and the
    CPU frequency governor, which should also be `performance` (powersave slows the data path and launches)."""
    results = []
    for check, read, hint in UNIFORM_FACTS:
        facts = _facts_by_node(reports, read)
        if not facts:
            results.append(CheckResult(check, "cluster", SKIP, "no node reported it"))
        elif len(set(facts.values())) > 1:
            results.append(CheckResult(check, "cluster", WARN, _spread(facts), hint))
        else:
            results.append(CheckResult(check, "cluster", PASS, next(iter(facts.values()))))
    governors = _facts_by_node(reports, lambda r: get(r, "cpu", "governor"))
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


IGNORED_PACKAGES = {"pip", "setuptools", "wheel", "nodectl"}


def check_packages(reports: Mapping[str, Mapping]) -> CheckResult:
    packages = {node: r.get("packages") or {} for node, r in reports.items()}
    names = set().union(*(p.keys() for p in packages.values())) - IGNORED_PACKAGES if packages else set()
    differing = sorted(n for n in names if len({p.get(n, "-") for p in packages.values()}) > 1)
    if differing:
        shown = ", ".join(differing[:12]) + (f" and {len(differing) - 12} more" if len(differing) > 12 else "")
        return CheckResult("same packages", "cluster", WARN, f"{len(differing)} differ: {shown}",
                           "nodectl env-dump --diff lists the versions per node")
    return CheckResult("same packages", "cluster", PASS, f"{len(names)} packages agree")


def check_gpu_models(reports: Mapping[str, Mapping]) -> CheckResult:
    models = {node: sorted({d["name"] for d in get(r, "gpus", "devices", default=[])}) for node, r in reports.items()}
    distinct = {tuple(m) for m in models.values() if m}
    if len(distinct) > 1:
        return CheckResult("one GPU model", "cluster", FAIL,
                           "; ".join(f"{node}: {', '.join(m)}" for node, m in models.items()),
                           "a run is as fast as its slowest GPU; exclude the odd nodes with --exclude")
    return CheckResult("one GPU model", "cluster", PASS, ", ".join(next(iter(distinct), ("none",))))


def check_workdir(node: str, report: Mapping) -> CheckResult:
    """The workdir must take the run folders: created and written by the login user."""
    reason = unreadable(report, "disk")
    disk = report.get("disk") or {}
    if reason or "writable" not in disk:
        return CheckResult("workdir", node, SKIP, reason or "writability not probed")
    where = disk.get("workdir", "workdir")
    if not disk["writable"]:
        return CheckResult("workdir", node, FAIL, f"{where} cannot be written ({disk.get('write_error')})",
                           "set workdir: in hosts.yaml to a folder the login user owns (e.g. ~/nodectl or a local "
                           "scratch disk), or fix its owner and mode")
    return CheckResult("workdir", node, PASS, f"{where} writable")


def check_clock(node: str, report: Mapping) -> CheckResult:
    skew = get(report, "clock", "skew_s")
    if skew is None:
        return CheckResult("clock", node, SKIP, "no clock reading")
    slack = (get(report, "clock", "round_trip_s", default=0) or 0) / 2
    effective = max(0.0, abs(skew) - slack)
    hint = "run chrony or systemd-timesyncd on every node; logs and heartbeats are compared by time"
    if effective > SKEW_FAIL:
        return CheckResult("clock", node, FAIL, f"{skew:+.1f}s from the controller", hint)
    if effective > SKEW_WARN:
        return CheckResult("clock", node, WARN, f"{skew:+.1f}s from the controller", hint)
    return CheckResult("clock", node, PASS, f"{skew:+.2f}s")


def check_master_port(node: str, port_answer: Mapping | None) -> CheckResult:
    if port_answer is None:
        return CheckResult("master port", node, SKIP, "not node 0")
    if port_answer.get("free"):
        return CheckResult("master port", node, PASS, f"port {port_answer['port']} free")
    return CheckResult("master port", node, FAIL, f"port {port_answer.get('asked')} is in use on node 0",
                       "stop what holds it or set another master_port: in hosts.yaml")


def check_reach_master(node: str, answer: Mapping | None, target: str) -> CheckResult:
    if answer is None:
        return CheckResult("reach master", node, SKIP, "not tested")
    if answer.get("ok"):
        return CheckResult("reach master", node, PASS, f"{target} in {answer.get('ms', 0):.0f} ms")
    return CheckResult("reach master", node, FAIL, f"cannot open {target}: {answer.get('error')}",
                       "open the master port on node 0's firewall to the other nodes, or set addr: of node 0 to "
                       "an address they can reach")


def check_route(node: str, answer: Mapping | None, master_addr: str) -> CheckResult:
    """The interface a node uses toward the master address; docker, virtual or lo is usually a wrong pick."""
    if not answer or not answer.get("dev"):
        return CheckResult("interface", node, SKIP, "route unknown")
    dev = answer["dev"]
    loopback_master = master_addr.startswith("127.") or master_addr in ("localhost", "::1")
    if dev.startswith(VIRTUAL_PREFIXES) and not loopback_master:
        return CheckResult("interface", node, WARN, f"{master_addr} is reached through {dev}",
                           "pin the right NIC for NCCL and gloo", {"NCCL_SOCKET_IFNAME": "<your NIC>",
                                                                   "GLOO_SOCKET_IFNAME": "<your NIC>"})
    return CheckResult("interface", node, PASS, f"{dev} toward {master_addr}",
                       env=None if loopback_master else {"NCCL_SOCKET_IFNAME": dev, "GLOO_SOCKET_IFNAME": dev})


CheckFn = Callable[..., CheckResult]


def judge_node(node: str, report: Mapping, device: str, expect: Expectation,
               extras: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
               gpus: int | None = None) -> list[CheckResult]:
    """Every per-node check for one node's report (extras: p2p, port, reach and route answers; env: what the
    inventory sets for the node's ranks; gpus: the node's `gpus:`)."""
    extras = extras or {}
    results = [check_torch(node, report, device)]
    if device == "cuda":
        results += [check_gpu_count(node, report, expect.gpus, gpus), check_gpus_idle(node, report), check_ecc(node, report),
                    check_persistence(node, report), check_p2p(node, extras.get("p2p")), check_nvlink(node, report),
                    check_infiniband(node, report), check_memlock(node, report)]
        from nodectl.preflight.health import judge_health

        results += judge_health(node, report, env)
    results += [check_workdir(node, report), check_shm(node, report), check_disk(node, report),
                check_clock(node, report), check_nofile(node, report), check_socket_ifname(node, report, env or {})]
    if "port" in extras:
        results.append(check_master_port(node, extras["port"]))
    if "reach" in extras:
        results.append(check_reach_master(node, extras["reach"], f"{expect.master_addr}:{expect.master_port}"))
    if "route" in extras:
        results.append(check_route(node, extras["route"], expect.master_addr))
    return results


def judge_cluster(reports: Mapping[str, Mapping], devices: Mapping[str, str]) -> list[CheckResult]:
    results = check_versions(reports) + check_uniformity(reports)
    if any(d == "cuda" for d in devices.values()):
        results += [check_gpu_models(reports), check_ib_rates(reports)]
    return results
