"""GPU and fabric health checks (issue 16): pure functions of the probe's NVML, sysfs and kernel-log facts and of
the GPU job's measurements (launchers/gpuhealth.py). Thresholds and their sources are in docs/PREFLIGHT.md."""
from __future__ import annotations

import re
import statistics
from typing import Mapping

from nodectl.preflight.verdict import FAIL, PASS, SKIP, WARN, CheckResult, get, skip_if_unreadable, unreadable

# A GPU under this share of the median of its peers (same model) is named: healthy GPUs of one model land within
# a few percent of each other in these figures; throttling, a bad HBM stack or a downtrained link do not.
PERF_FLOOR = {"gemm_tflops": 0.85, "hbm_gbps": 0.85, "h2d_gbps": 0.7, "d2h_gbps": 0.7}
PERF_LABEL = {"gemm_tflops": ("bf16 GEMM", "TFLOP/s"), "hbm_gbps": ("HBM copy", "GB/s"),
              "h2d_gbps": ("host-to-device", "GB/s"), "d2h_gbps": ("device-to-host", "GB/s")}
HOT_MARGIN_C = 5
# Clock event reasons that mean the GPU is slowed by something wrong (NVML nvmlClocksEventReasons): power brake
# (the board asked for it), hardware slowdown (thermal or power), software thermal slowdown. "sw power cap" is a
# GEMM at its power limit, the normal state of a loaded H100/H200.
BAD_CLOCK_EVENTS = ("hw slowdown", "hw thermal slowdown", "hw power brake", "sw thermal slowdown")
# Xid codes that mean the GPU needs a reset or the node a drain (NVIDIA's Xid catalog and GPU debug guidelines):
# double-bit ECC, row-remap failure, NVLink error, fallen off the bus, high single-bit ECC rate, contained and
# uncontained ECC errors, GSP RPC timeout and error, unrecovered ECC.
RESET_XIDS = {48: "double-bit ECC error", 63: "row remapping event", 64: "row remapping failure",
              74: "NVLink error", 79: "GPU fell off the bus", 92: "high single-bit ECC error rate",
              94: "contained ECC error", 95: "uncontained ECC error", 119: "GSP RPC timeout", 120: "GSP error",
              140: "unrecovered ECC error"}
FABRIC_STATES = {0: "not supported", 1: "not started", 2: "in progress", 3: "completed"}
COMPUTE_MODES = {0: "default", 1: "exclusive thread", 2: "prohibited", 3: "exclusive process"}
IB_RATE = re.compile(r"([\d.]+)\s*Gb/sec")


def _devices(report: Mapping) -> list[Mapping]:
    return get(report, "gpus", "devices", default=[]) or []


def _gpu(device: Mapping) -> str:
    return f"GPU{device.get('index', '?')}"


# ---- per-GPU facts the probe reads without loading the GPU (every tier) -----------------------------------------

@skip_if_unreadable("pcie link", "gpus")
def check_pcie_link(node: str, report: Mapping) -> CheckResult:
    """Link width below the maximum is a downtrained link (a reseat or a riser). The generation trains down at idle
    to save power, so it is judged under load, by the GPU job."""
    devices = [d for d in _devices(report) if d.get("pcie_width") and d.get("pcie_width_max")]
    if not devices:
        return CheckResult("pcie link", node, SKIP, "NVML gives no PCIe link width here")
    narrow = [f"{_gpu(d)} x{d['pcie_width']} of x{d['pcie_width_max']}" for d in devices
              if d["pcie_width"] < d["pcie_width_max"]]
    if narrow:
        return CheckResult("pcie link", node, FAIL, "PCIe link narrower than it can be: " + "; ".join(narrow),
                           "reseat the GPU or its riser; nvidia-smi -q -d PCIE shows current and max")
    widths = sorted({d["pcie_width"] for d in devices})
    return CheckResult("pcie link", node, PASS, f"x{'/x'.join(map(str, widths))} on {len(devices)} GPU(s)")


@skip_if_unreadable("thermal", "gpus")
def check_thermal(node: str, report: Mapping) -> CheckResult:
    """At rest: a GPU already slowed by hardware, or within 5 C of its slowdown temperature, will throttle under
    load."""
    devices = _devices(report)
    bad = [f"{_gpu(d)} {', '.join(e for e in d.get('clock_events') or [] if e in BAD_CLOCK_EVENTS)}"
           for d in devices if set(d.get("clock_events") or []) & set(BAD_CLOCK_EVENTS)]
    hot = [f"{_gpu(d)} {d['temperature_c']} C (slowdown at {d['slowdown_c']} C)" for d in devices
           if d.get("temperature_c") is not None and d.get("slowdown_c")
           and d["temperature_c"] >= d["slowdown_c"] - HOT_MARGIN_C]
    if bad:
        return CheckResult("thermal", node, FAIL, "clocks slowed at rest: " + "; ".join(bad) +
                           (f"; {'; '.join(hot)}" if hot else ""),
                           "check cooling, fans and the power supply (nvidia-smi -q -d PERFORMANCE,TEMPERATURE)")
    if hot:
        return CheckResult("thermal", node, WARN, "; ".join(hot), "check cooling before a long run")
    temps = [d["temperature_c"] for d in devices if d.get("temperature_c") is not None]
    if not temps:
        return CheckResult("thermal", node, SKIP, "NVML gives no temperature here")
    return CheckResult("thermal", node, PASS, f"{min(temps)}-{max(temps)} C, no slowdown")


@skip_if_unreadable("mig", "gpus")
def check_mig_compute_mode(node: str, report: Mapping) -> CheckResult:
    """MIG splits a GPU into instances that NCCL cannot join into one job; a prohibited compute mode forbids any
    CUDA context. A pending MIG change applies only at the next GPU reset."""
    problems, notes = [], []
    for d in _devices(report):
        if d.get("mig_mode") == 1:
            problems.append(f"{_gpu(d)} has MIG enabled")
        elif d.get("mig_pending") is not None and d.get("mig_mode") is not None and d["mig_pending"] != d["mig_mode"]:
            notes.append(f"{_gpu(d)} has a MIG change pending (applies at reset)")
        if d.get("compute_mode") == 2:
            problems.append(f"{_gpu(d)} compute mode is prohibited")
        elif d.get("compute_mode") in (1, 3):
            notes.append(f"{_gpu(d)} compute mode is {COMPUTE_MODES[d['compute_mode']]}")
    if problems:
        return CheckResult("mig", node, FAIL, "; ".join(problems),
                           "sudo nvidia-smi -i N -mig 0 and reset the GPU; sudo nvidia-smi -i N -c DEFAULT")
    if notes:
        return CheckResult("mig", node, WARN, "; ".join(notes),
                           "one rank per GPU works in exclusive-process mode, but nothing else (a debugger, "
                           "a second job) can share it; reset the GPU to apply a pending MIG change")
    if all(d.get("mig_mode") is None and d.get("compute_mode") is None for d in _devices(report)):
        return CheckResult("mig", node, SKIP, "NVML gives no MIG or compute mode here")
    return CheckResult("mig", node, PASS, "MIG off, compute mode default")


@skip_if_unreadable("fabric manager", "gpus")
def check_fabric(node: str, report: Mapping) -> CheckResult:
    """On NVSwitch systems (HGX) every GPU must be registered with the fabric (nvidia-fabricmanager) before CUDA
    can use NVLink between GPUs; until then CUDA calls fail or hang."""
    fabric = [(d, d.get("fabric")) for d in _devices(report)]
    known = [(d, f) for d, f in fabric if isinstance(f, Mapping) and f.get("state") not in (None, 0)]
    if not known:
        return CheckResult("fabric manager", node, SKIP, "no NVSwitch fabric (or a driver without the query)")
    bad = [f"{_gpu(d)} {FABRIC_STATES.get(f['state'], f['state'])}" + (f" status {f.get('status')}"
                                                                      if f.get("status") else "")
           for d, f in known if f["state"] != 3 or f.get("status")]
    if bad:
        return CheckResult("fabric manager", node, FAIL, "NVSwitch fabric not ready: " + "; ".join(bad),
                           "systemctl status nvidia-fabricmanager (its version must equal the driver's); "
                           "journalctl -u nvidia-fabricmanager")
    return CheckResult("fabric manager", node, PASS, f"{len(known)} GPU(s) registered with the NVSwitch fabric")


@skip_if_unreadable("nvlink errors", "gpus")
def check_nvlink_health(node: str, report: Mapping) -> CheckResult:
    """A GPU with fewer active links than its peers runs the node's NVLink traffic at its pace; replay and
    recovery counts mean a marginal link (NVLink error counters, NVML field values)."""
    devices = [d for d in _devices(report) if d.get("nvlinks")]
    if not devices or not any(d.get("nvlinks_active") for d in devices):
        return CheckResult("nvlink errors", node, SKIP, "no active NVLink")
    most = max(d.get("nvlinks_active", 0) for d in devices)
    fewer = [f"{_gpu(d)} {d.get('nvlinks_active', 0)} of {most} links active" for d in devices
             if 0 < d.get("nvlinks_active", 0) < most]
    if fewer:
        return CheckResult("nvlink errors", node, FAIL, "; ".join(fewer),
                           "a link is down: nvidia-smi nvlink -s; reset the GPU, else the baseboard needs service")
    counted = [(d, d.get("nvlink_errors")) for d in devices if isinstance(d.get("nvlink_errors"), Mapping)]
    errors = [f"{_gpu(d)} " + ", ".join(f"{k} {v}" for k, v in e.items() if v) for d, e in counted
              if any(e.values())]
    if errors:
        return CheckResult("nvlink errors", node, WARN, "NVLink error counters: " + "; ".join(errors),
                           "counts since the driver loaded: nvidia-smi nvlink -e; rising replay or recovery "
                           "counts mean a marginal link")
    if not counted:
        return CheckResult("nvlink errors", node, PASS, f"{most} links active per GPU (error counters not readable)")
    return CheckResult("nvlink errors", node, PASS, f"{most} links active per GPU, no errors counted")


def check_xid(node: str, report: Mapping) -> CheckResult:
    """Xid (GPU) and SXid (NVSwitch) events in the kernel log since boot."""
    reason = unreadable(report, "kernel_events")
    if reason:
        return CheckResult("xid", node, SKIP, reason)
    log = report["kernel_events"]
    if not log.get("readable"):
        return CheckResult("xid", node, SKIP, f"kernel log not readable: {log.get('reason')}",
                           "run as root, or sysctl kernel.dmesg_restrict=0, or add the user to group adm")
    events = log.get("events") or []
    if not events:
        return CheckResult("xid", node, PASS, "no Xid or SXid since boot")
    gpu_at = {str(d.get("pci_bus_id") or "").lower()[-12:]: _gpu(d) for d in _devices(report)}

    def where(event):
        pci = event.get("pci", "")
        return next((name for bus, name in gpu_at.items() if bus and pci and pci[-12:] in bus), pci)

    fatal = [e for e in events if e.get("kind") == "xid" and e.get("code") in RESET_XIDS]
    others = [e for e in events if e not in fatal]
    if fatal:
        named = sorted({f"Xid {e['code']} ({RESET_XIDS[e['code']]}) on {where(e)}" for e in fatal})
        return CheckResult("xid", node, FAIL, "; ".join(named[:6]) + f"; last: {fatal[-1].get('text', '')[-120:]}",
                           "reset the GPU (nvidia-smi -r) or reboot, and drain the node if it comes back")
    named = sorted({f"{e.get('kind', 'xid').upper().replace('SXID', 'SXid').replace('XID', 'Xid')} {e.get('code')}"
                    f" on {where(e)}" for e in others})
    return CheckResult("xid", node, WARN, f"{len(others)} event(s) since boot: " + "; ".join(named[:6]),
                       "application-caused codes (13, 31, 43, 45) follow a crashed job; repeated ones, or any "
                       "SXid, deserve a look at dmesg")


# ---- network ----------------------------------------------------------------------------------------------------

def _ib_ports(report: Mapping) -> list[tuple[Mapping, Mapping]]:
    devices = report.get("infiniband") or []
    if not isinstance(devices, list):
        return []
    return [(d, p) for d in devices for p in d.get("ports", [])]


def ib_rate(port: Mapping) -> float | None:
    match = IB_RATE.search(str(port.get("rate") or ""))
    return float(match[1]) if match else None


def check_ib_rates(reports: Mapping[str, Mapping]) -> CheckResult:
    """Every active port's rate against the fastest active port of its link layer in the cluster: a port that came
    up at a lower rate (a bad cable or transceiver) sets the pace of every collective through it."""
    rates = {}
    for node, report in reports.items():
        for device, port in _ib_ports(report):
            rate = ib_rate(port)
            if rate and "ACTIVE" in str(port.get("state") or ""):
                rates[(node, f"{device['name']}/{port['port']}")] = (port.get("link_layer") or "?", rate)
    if not rates:
        return CheckResult("ib rate", "cluster", SKIP, "no active InfiniBand/RoCE port")
    fastest = {}
    for layer, rate in rates.values():
        fastest[layer] = max(fastest.get(layer, 0), rate)
    slow = [f"{node} {port} {rate:g} Gb/s" for (node, port), (layer, rate) in rates.items() if rate < fastest[layer]]
    if slow:
        return CheckResult("ib rate", "cluster", WARN, "ports below the fastest of their kind ("
                           + ", ".join(f"{layer} {rate:g} Gb/s" for layer, rate in fastest.items()) + "): "
                           + "; ".join(slow[:8]),
                           "ibstat on those nodes; reseat or replace the cable or transceiver, or leave the port "
                           "out with NCCL_IB_HCA if it is not meant for training")
    return CheckResult("ib rate", "cluster", PASS, ", ".join(f"{len(rates)} port(s) at {layer} {rate:g} Gb/s"
                                                              for layer, rate in fastest.items()))


def check_ib_errors(node: str, report: Mapping) -> CheckResult:
    ports = _ib_ports(report)
    if not ports:
        return CheckResult("ib errors", node, SKIP, "no InfiniBand/RoCE port")
    counted = [(d, p, p.get("counters")) for d, p in ports if isinstance(p.get("counters"), Mapping)]
    if not any(c for _, _, c in counted):
        return CheckResult("ib errors", node, SKIP, "port error counters not readable")
    errors = [f"{d['name']}/{p['port']} " + ", ".join(f"{k} {v}" for k, v in c.items() if v)
              for d, p, c in counted if any(c.values())]
    if errors:
        return CheckResult("ib errors", node, WARN, "; ".join(errors[:6]),
                           "counts since the driver loaded: clear them (perfquery -x -R) and check again after a "
                           "collective; rising symbol or receive errors mean a bad cable or transceiver")
    return CheckResult("ib errors", node, PASS, f"no errors counted on {len(counted)} port(s)")


def check_gpudirect(node: str, report: Mapping) -> CheckResult:
    """GPUDirect RDMA lets the NIC read GPU memory directly; without it NCCL stages every message through host
    memory. It needs nvidia_peermem (or, with NCCL 2.19+ and the open kernel modules, DMA-BUF)."""
    if not _ib_ports(report) or not _devices(report):
        return CheckResult("gpudirect", node, SKIP, "needs both GPUs and an InfiniBand/RoCE port")
    modules = report.get("modules") or {}
    if unreadable(report, "modules"):
        return CheckResult("gpudirect", node, SKIP, unreadable(report, "modules"))
    if modules.get("nvidia_peermem") or modules.get("nv_peer_mem"):
        return CheckResult("gpudirect", node, PASS, "nvidia_peermem loaded")
    return CheckResult("gpudirect", node, WARN, "nvidia_peermem is not loaded",
                       "sudo modprobe nvidia_peermem (and add it to /etc/modules-load.d); without it NCCL uses "
                       "GPUDirect RDMA only through DMA-BUF (open kernel modules, NCCL 2.19+): check for GDRDMA in "
                       "the collective's NCCL transports")


def check_numa(node: str, report: Mapping) -> CheckResult:
    """Each GPU should have an InfiniBand/RoCE NIC on its own NUMA node: traffic to a NIC across the socket
    link halves its bandwidth on most two-socket boards."""
    nics = {d.get("numa_node") for d, _ in _ib_ports(report) if d.get("numa_node") is not None
            and d.get("numa_node") >= 0}
    gpus = [d for d in _devices(report) if d.get("numa_node") is not None and d["numa_node"] >= 0]
    if not nics or not gpus:
        return CheckResult("numa", node, SKIP, "NUMA nodes of GPUs and NICs not known (one socket, a VM, or no NIC)")
    far = [f"{_gpu(d)} (NUMA {d['numa_node']})" for d in gpus if d["numa_node"] not in nics]
    if far:
        return CheckResult("numa", node, WARN, f"no NIC on the NUMA node of {', '.join(far)}; NICs on NUMA "
                                               f"{', '.join(map(str, sorted(nics)))}",
                           "check the board's GPU/NIC layout (nvidia-smi topo -m); NCCL picks the nearest NIC, "
                           "but these GPUs cross the socket link")
    return CheckResult("numa", node, PASS, f"every GPU has a NIC on its NUMA node ({len(nics)} NUMA node(s))")


def _hca_names(value: str) -> tuple[bool, bool, list[tuple[str, int | None]]]:
    """NCCL_IB_HCA as NCCL reads it: `^` excludes, `=` matches names exactly (else as prefixes), `name:port`."""
    value = value.strip()
    exclude = value.startswith("^")
    value = value.lstrip("^")
    exact = value.startswith("=")
    entries = []
    for part in value.lstrip("=").split(","):
        name, _, port = part.strip().partition(":")
        if name:
            entries.append((name, int(port) if port.isdigit() else None))
    return exclude, exact, entries


def check_ib_hca(node: str, report: Mapping, env: Mapping[str, str]) -> CheckResult:
    value = (env or {}).get("NCCL_IB_HCA")
    if not value:
        return CheckResult("ib hca", node, PASS, "NCCL_IB_HCA not set (NCCL uses every active HCA)")
    reason = unreadable(report, "infiniband")
    if reason:
        return CheckResult("ib hca", node, SKIP, reason)
    ports = {(d["name"], p["port"]): "ACTIVE" in str(p.get("state") or "") for d, p in _ib_ports(report)}
    active = sorted({f"{name}:{port}" for (name, port), up in ports.items() if up})
    exclude, exact, entries = _hca_names(value)
    if exclude:
        left = [k for k in ports if not any((k[0] == n if exact else k[0].startswith(n)) for n, _ in entries)]
        if not any(ports[k] for k in left):
            return CheckResult("ib hca", node, FAIL, f"NCCL_IB_HCA={value} leaves no active port",
                               f"active ports: {', '.join(active) or 'none'}")
        return CheckResult("ib hca", node, PASS, f"NCCL_IB_HCA={value}")
    problems = []
    for name, port in entries:
        hits = [k for k in ports if (k[0] == name if exact else k[0].startswith(name)) and port in (None, k[1])]
        if not hits:
            problems.append(f"no {name}{f':{port}' if port else ''} on the node")
        elif not any(ports[k] for k in hits):
            problems.append(f"{name}{f':{port}' if port else ''} is not ACTIVE")
    if problems:
        return CheckResult("ib hca", node, FAIL, f"NCCL_IB_HCA={value}: " + "; ".join(problems),
                           f"name active ports in the inventory's env: ({', '.join(active) or 'none active'})")
    return CheckResult("ib hca", node, PASS, f"NCCL_IB_HCA={value}")


# ---- measured under load: the GPU job (default tier) ------------------------------------------------------------

def cluster_medians(jobs: Mapping[str, Mapping | None], reports: Mapping[str, Mapping]) -> dict:
    """Per GPU model, the median of each figure over every GPU of the cluster."""
    values: dict = {}
    for node, job in jobs.items():
        for device in (job or {}).get("devices") or []:
            for metric in PERF_FLOOR:
                if isinstance(device.get(metric), (int, float)):
                    values.setdefault((device.get("name"), metric), []).append(device[metric])
    return {key: statistics.median(v) for key, v in values.items()}


def check_gpu_perf(node: str, job: Mapping | None, medians: Mapping | None = None) -> list[CheckResult]:
    """Each GPU's GEMM, HBM, H2D and D2H figures against the median of the node's GPUs of its model and of the
    cluster's; the clock events, temperature and PCIe generation seen while loaded."""
    if not job:
        return [CheckResult("gpu perf", node, SKIP, "no GPU job ran (--quick, or no GPU)")]
    if "error" in job:
        return [CheckResult("gpu perf", node, FAIL, f"the GPU job failed: {job['error']}",
                            "run launchers/gpuhealth.py on the node by hand; check nvidia-smi and dmesg")]
    devices = job.get("devices") or []
    broken = [f"{_gpu(d)}: {d['error']}" for d in devices if d.get("error")]
    if broken:
        return [CheckResult("gpu perf", node, FAIL, "; ".join(broken), "check nvidia-smi and dmesg on the node")]
    return [_judge_figures(node, devices, medians or {}), _judge_under_load(node, devices)]


def _judge_figures(node: str, devices: list[Mapping], medians: Mapping) -> CheckResult:
    slow, summary = [], []
    for metric, floor in PERF_FLOOR.items():
        label, unit = PERF_LABEL[metric]
        mine = [d[metric] for d in devices if isinstance(d.get(metric), (int, float))]
        if not mine:
            continue
        summary.append(f"{label} {statistics.median(mine):g} {unit}")
        for d in devices:
            value = d.get(metric)
            if not isinstance(value, (int, float)):
                continue
            # against the node's OTHER GPUs: with two GPUs a median that counts the slow one hides half its loss
            peers = [p[metric] for p in devices if p is not d and isinstance(p.get(metric), (int, float))]
            node_median = statistics.median(peers) if peers else None
            cluster = medians.get((d.get("name"), metric))
            for scope, reference in (("the node's other GPUs'", node_median), ("the cluster's", cluster)):
                if reference and value < floor * reference:
                    slow.append(f"{_gpu(d)} {label} {value:g} {unit}, {value / reference:.0%} of {scope} median "
                                f"{reference:g}")
                    break
    if not summary:
        return CheckResult("gpu perf", node, SKIP, "the GPU job measured nothing")
    if slow:
        return CheckResult("gpu perf", node, FAIL, "; ".join(slow[:6]),
                           "a GPU that is slow alone is throttled, shared or failing: nvidia-smi -q -d "
                           "PERFORMANCE,CLOCK,PCIE on the node; leave it out with CUDA_VISIBLE_DEVICES until fixed")
    return CheckResult("gpu perf", node, PASS, f"{len(devices)} GPU(s) within range, medians " + ", ".join(summary))


def _judge_under_load(node: str, devices: list[Mapping]) -> CheckResult:
    problems, notes = [], []
    for d in devices:
        events = [e for e in d.get("clock_events") or [] if e in BAD_CLOCK_EVENTS]
        if events:
            problems.append(f"{_gpu(d)} throttled under load: {', '.join(events)}")
    gens = [d.get("pcie_gen") for d in devices if d.get("pcie_gen")]
    if gens:
        best = max(gens)
        notes += [f"{_gpu(d)} reached PCIe gen {d['pcie_gen']} (others {best})" for d in devices
                  if d.get("pcie_gen") and d["pcie_gen"] < best]
    if problems:
        return CheckResult("gpu load", node, FAIL, "; ".join(problems),
                           "check cooling and power (nvidia-smi -q -d PERFORMANCE); a GPU that slows itself slows "
                           "every rank")
    if notes:
        return CheckResult("gpu load", node, WARN, "; ".join(notes),
                           "a link that trains to a lower generation under load: reseat the GPU, check BIOS PCIe "
                           "settings")
    temps = [d.get("temperature_c") for d in devices if d.get("temperature_c")]
    return CheckResult("gpu load", node, PASS, "no throttling under load" + (f", up to {max(temps)} C" if temps else "")
                       + (f", PCIe gen {max(gens)}" if gens else ""))


def judge_health(node: str, report: Mapping, env: Mapping[str, str] | None = None) -> list[CheckResult]:
    """The probe-only health checks of a GPU node (every tier)."""
    return [check_pcie_link(node, report), check_thermal(node, report), check_mig_compute_mode(node, report),
            check_fabric(node, report), check_nvlink_health(node, report), check_xid(node, report),
            check_ib_errors(node, report), check_gpudirect(node, report), check_numa(node, report),
            check_ib_hca(node, report, env or {})]
