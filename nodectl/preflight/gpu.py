"""GPU checks: count and visibility, idle, ECC, persistence, peer copies, NVLink, PCIe link, heat, MIG and
compute mode, the NVSwitch fabric, Xid events, GPU-NIC NUMA placement, and the GPU job's figures under load
(launchers/gpuhealth.py). Pure functions of the probe report and that job's answer; thresholds and their
sources are in docs/PREFLIGHT.md."""
from __future__ import annotations

import statistics
from typing import Mapping

from nodectl.preflight.checks import MEASURED, check
from nodectl.probe_report import ProbeReport
from nodectl.preflight.network import ib_ports
from nodectl.preflight.verdict import FAIL, PASS, SKIP, WARN, CheckResult, gib, result

GPU_BUSY_BYTES = 1 << 30


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


def _gpu(device: Mapping) -> str:
    """A GPU of the GPU job's answer (launchers/gpuhealth.py), by index."""
    return f"GPU{device.get('index', '?')}"


# What NVML's error says, and the cure for that cause (not for another one): a driver upgraded without a reboot
# leaves the old kernel module loaded, which no driver install mends.
NVML_CURES = (
    ("version mismatch", "the driver was upgraded but the old kernel module is still loaded: reboot the node, or, "
                         "once no process uses the GPUs, reload the modules (systemctl stop nvidia-persistenced; "
                         "rmmod nvidia_uvm nvidia_drm nvidia_modeset nvidia; modprobe nvidia; nvidia-smi)"),
    ("nvidia-ml-py is not installed", "pip install nvidia-ml-py into the node's python (the one in hosts.yaml)"),
    ("Driver Not Loaded", "load the driver (modprobe nvidia) or install it; nvidia-smi must answer"),
    ("Insufficient Permissions", "let the login user open /dev/nvidia* (group video, or the device nodes' mode)"),
    ("Library Not Found", "install the NVIDIA driver's user-space libraries (libnvidia-ml.so.1) on the node"),
)


def nvml_cure(reason: str) -> str:
    return next((cure for cause, cure in NVML_CURES if cause.lower() in reason.lower()),
                "install the NVIDIA driver and nvidia-ml-py on the node, or use device: cpu")


@check("gpus", "gpu", given=lambda f: (f.report, f.expect.gpus, f.gpus), cuda_only=True, section="gpus",
       doc=(("gpus",
            "NVML device count after `CUDA_VISIBLE_DEVICES`; models; each GPU read on its own (one that raises, a "
            "GPU fallen off the bus, is reported with its error beside the others)",
            "fail: no GPU, with the cure for NVML's error (an NVML/RM version mismatch: reboot or reload the nvidia "
            "modules, not a driver install); a GPU that could not be read, by index (the other GPUs' checks stand); "
            "a `CUDA_VISIBLE_DEVICES` entry naming no GPU of the node; fewer visible GPUs than `--gpus`, else than "
            "the node's `gpus:`; mixed models on one node",
            "exact counts"),))
def check_gpu_count(node: str, report: ProbeReport, want: int | None,
                    inventory_gpus: int | None = None) -> CheckResult:
    """The GPUs the ranks will see (CUDA_VISIBLE_DEVICES applied by the probe) against what the launch asks:
    --gpus, else the node's `gpus:`; a CUDA_VISIBLE_DEVICES entry that names no GPU of the node fails."""
    gpus = report.gpus
    count = gpus.count or 0
    if not gpus.available:
        reason = gpus.reason or "?"
        return result(node, FAIL, f"no GPU visible: {reason}", nvml_cure(reason))
    if gpus.unresolved:
        total = gpus.count_all if gpus.count_all is not None else "?"
        return result(node, FAIL,
                      f"CUDA_VISIBLE_DEVICES={gpus.visible} names {gpus.unresolved[0]!r}, which is "
                      f"no GPU of this node (it has {total}: indexes 0-{total - 1 if isinstance(total, int) else '?'}"
                      f" or GPU-<uuid>); CUDA ignores it and every entry after it",
                      "fix CUDA_VISIBLE_DEVICES in this node's env: (nvidia-smi -L lists the GPUs)")
    asked, source = (want, "--gpus") if want else (inventory_gpus, "gpus: in hosts.yaml")
    if asked and count < asked:
        visible = " visible" if gpus.visible is not None else ""
        return result(node, FAIL, f"{count}{visible} GPU(s), {asked} asked by {source}",
                      f"lower {source} to {count} for this node, or make more GPUs visible to it")
    lost = gpus.lost
    if lost:
        named = "; ".join(f"{d.label}: {d.error}" for d in lost)
        return result(node, FAIL,
                      f"{len(lost)} of {count} GPU(s) could not be read ({named}); the other GPUs' checks stand",
                      "a GPU NVML calls lost has fallen off the bus: look for Xid 79 in dmesg; reset it "
                      "(nvidia-smi -r -i INDEX) or reboot; if it comes back, drain the node and report it")
    models = {d.name for d in gpus.read}
    if len(models) > 1:
        return result(node, FAIL, f"mixed GPU models on one node: {', '.join(sorted(models))}",
                      "set CUDA_VISIBLE_DEVICES in this node's env: to GPUs of one model")
    return result(node, PASS, f"{count}x {next(iter(models), '?')}")


@check("gpu idle", "gpu", cuda_only=True, section="gpus",
       doc=(("gpu idle",
            "NVML compute processes and memory used per visible GPU",
            "fail on any foreign process (pid, user) or over 1 GiB used with none listed",
            "1 GiB: above the CUDA context of an idle driver"),))
def check_gpus_idle(node: str, report: ProbeReport, own_pids: frozenset[int] = frozenset()) -> CheckResult:
    busy, notes = [], []
    for device in report.gpus.read:
        for proc in device.compute_processes:
            if proc.pid not in own_pids:
                busy.append(f"{device.label}: pid {proc.pid} ({proc.user or '?'})")
        used = device.memory_used_bytes or 0
        if used > GPU_BUSY_BYTES:
            notes.append(f"{device.label} has {gib(used)} in use")
    if busy:
        return result(node, FAIL, "; ".join(busy),
                      "stop those processes (a stray rank of an earlier run? `nodectl stop --run RUN`), "
                      "or leave those GPUs out with CUDA_VISIBLE_DEVICES")
    if notes:
        return result(node, FAIL, "; ".join(notes),
                      "memory is held with no compute process listed: another container or a zombie; "
                      "check nvidia-smi on the node")
    return result(node, PASS, "no foreign compute process")


@check("ecc", "gpu", cuda_only=True, section="gpus",
       doc=(("ecc",
            "NVML volatile uncorrectable ECC count, retired pages pending, row remap pending/failed",
            "fail on any",
            "any uncorrectable error or pending retirement means a reset or drain (NVIDIA's GPU memory error "
            "management guide)"),))
def check_ecc(node: str, report: ProbeReport) -> CheckResult:
    bad = []
    for d in report.gpus.read:
        if (d.ecc_volatile_uncorrected or 0) > 0:
            bad.append(f"{d.label}: {d.ecc_volatile_uncorrected} uncorrectable ECC errors")
        if d.retired_pages_pending:
            bad.append(f"{d.label}: retired pages pending")
        if d.remapped_rows_pending or d.remapped_rows_failed:
            bad.append(f"{d.label}: row remapping {'failed' if d.remapped_rows_failed else 'pending'}")
    if bad:
        return result(node, FAIL, "; ".join(bad),
                      "reset the GPU when idle (pending retirements/remaps apply at reset) or drain the node")
    counted = ("ecc_volatile_uncorrected", "retired_pages_pending", "remapped_rows_pending", "remapped_rows_failed")
    if report.gpus.read and not any(getattr(d, key) is not None for d in report.gpus.read for key in counted):
        return result(node, SKIP, "NVML gives no ECC or row-remap counts here (ECC off?)")
    return result(node, PASS, "no uncorrectable errors or pending retirements")


@check("persistence", "gpu", cuda_only=True, section="gpus",
       doc=(("persistence",
            "NVML persistence mode",
            "warn when off",
            "slow first CUDA calls (nvidia-smi docs)"),))
def check_persistence(node: str, report: ProbeReport) -> CheckResult:
    off = [str(d.index) for d in report.gpus.read if not d.persistence_mode]
    if off:
        return result(node, WARN, f"persistence mode off on GPU {','.join(off)}",
                      "sudo nvidia-smi -pm 1 (or enable nvidia-persistenced) to avoid slow first CUDA calls")
    return result(node, PASS, "on")


@check("p2p", "gpu", given=lambda f: (f.extras.get("p2p"),), cuda_only=True, tiers=MEASURED,
       doc=(("p2p (default tier)",
            "the GPU job: a value-checked copy between every visible GPU pair and its bandwidth",
            "fail on wrong data or an error, with `NCCL_P2P_DISABLE=1` as the fix",
            "the \"P2P reports available then fails\" case (ACS/IOMMU)"),))
def check_p2p(node: str, p2p: Mapping | None) -> CheckResult:
    if not p2p:
        return result(node, SKIP, "not measured (--quick)")
    if "error" in p2p:
        return result(node, FAIL, f"P2P test failed: {p2p['error']}",
                      "NCCL_P2P_DISABLE=1 for this node; check ACS/IOMMU settings in BIOS and kernel",
                      {"NCCL_P2P_DISABLE": "1"})
    broken = [f"{p['src']}->{p['dst']}: {p.get('error') or 'wrong data'}" for p in p2p.get("pairs", [])
              if not p.get("ok")]
    if broken:
        return result(node, FAIL, "; ".join(broken[:4]),
                      "GPU peer copies fail or corrupt data: set NCCL_P2P_DISABLE=1 for this node; usually "
                      "PCIe ACS or the IOMMU blocks peer traffic (disable ACS, or iommu=pt)",
                      {"NCCL_P2P_DISABLE": "1"})
    pairs = p2p.get("pairs", [])
    if not pairs:
        return result(node, SKIP, "fewer than 2 GPUs")
    slowest = min((p["gbps"] for p in pairs), default=0)
    peer = sum(1 for p in pairs if p.get("peer_access"))
    return result(node, PASS, f"{len(pairs)} pairs correct, {peer} with peer access, "
                              f"slowest {slowest:.0f} GB/s")


@check("nvlink", "gpu", cuda_only=True, section="gpus",
       doc=(("nvlink",
            "NVML NVLink state per link",
            "fail when a GPU has fewer active links than its peers (none included)",
            "`nvidia-smi nvlink -s`"),))
def check_nvlink(node: str, report: ProbeReport) -> CheckResult:
    """Active NVLink links per GPU: a GPU with fewer than its peers (none at all included) runs the node's NVLink
    traffic at its pace, or falls back to PCIe."""
    devices = report.gpus.read
    if len(devices) < 2:
        return result(node, SKIP, "fewer than 2 GPUs")
    most = max(d.nvlinks_active or 0 for d in devices)
    if not most:
        return result(node, PASS, "no NVLink (PCIe only)")
    fewer = [f"{d.label} {d.nvlinks_active or 0} of {most} links active" for d in devices
             if (d.nvlinks_active or 0) < most]
    if fewer:
        return result(node, FAIL, "; ".join(fewer),
                      "a link is down: nvidia-smi nvlink -s; reset the GPU, else the baseboard needs service")
    return result(node, PASS, f"{most} active links per GPU")


@check("nvlink errors", "gpu", cuda_only=True, section="gpus",
       doc=(("nvlink errors",
            "NVML field values NVLINK_{CRC_FLIT,CRC_DATA,REPLAY,RECOVERY}_ERROR_COUNT_TOTAL",
            "warn on any counted error; skip (not pass) when NVML gives no counters",
            "`nvidia-smi nvlink -e`"),))
def check_nvlink_errors(node: str, report: ProbeReport) -> CheckResult:
    """NVLink error counters (NVML field values): replay and recovery counts mean a marginal link. How many links
    are up is check_nvlink's."""
    devices = [d for d in report.gpus.read if d.nvlinks_active]
    if not devices:
        return result(node, SKIP, "no active NVLink")
    counted = [(d, d.nvlink_errors) for d in devices if d.nvlink_errors is not None]
    errors = [f"{d.label} " + ", ".join(f"{k} {v}" for k, v in e.items() if v) for d, e in counted
              if any(e.values())]
    if errors:
        return result(node, WARN, "NVLink error counters: " + "; ".join(errors),
                      "counts since the driver loaded: nvidia-smi nvlink -e; rising replay or recovery "
                      "counts mean a marginal link")
    if not counted:   # could not look: said as such, never a pass
        return result(node, SKIP, "NVML gives no NVLink error counters here")
    return result(node, PASS, "no errors counted")


@check("pcie link", "gpu", cuda_only=True, section="gpus",
       doc=(("pcie link",
            "NVML current vs max PCIe link width",
            "fail when narrower (the generation trains down at idle, so it is judged under load)",
            "`nvidia-smi -q -d PCIE`"),))
def check_pcie_link(node: str, report: ProbeReport) -> CheckResult:
    """Link width below the maximum is a downtrained link (a reseat or a riser). The generation trains down at idle
    to save power, so it is judged under load, by the GPU job."""
    devices = [d for d in report.gpus.read if d.pcie_width and d.pcie_width_max]
    if not devices:
        return result(node, SKIP, "NVML gives no PCIe link width here")
    narrow = [f"{d.label} x{d.pcie_width} of x{d.pcie_width_max}" for d in devices
              if d.pcie_width < d.pcie_width_max]
    if narrow:
        return result(node, FAIL, "PCIe link narrower than it can be: " + "; ".join(narrow),
                      "reseat the GPU or its riser; nvidia-smi -q -d PCIE shows current and max")
    widths = sorted({d.pcie_width for d in devices})
    return result(node, PASS, f"x{'/x'.join(map(str, widths))} on {len(devices)} GPU(s)")


@check("thermal", "gpu", cuda_only=True, section="gpus",
       doc=(("thermal",
            "NVML clock event reasons and temperature at rest, slowdown threshold",
            "fail when slowed by hardware or sw thermal at rest; warn within 5 C of the slowdown temperature",
            "NVML temperature thresholds"),))
def check_thermal(node: str, report: ProbeReport) -> CheckResult:
    """At rest: a GPU already slowed by hardware, or within 5 C of its slowdown temperature, will throttle under
    load."""
    devices = report.gpus.read
    bad = [f"{d.label} {', '.join(e for e in d.clock_events or () if e in BAD_CLOCK_EVENTS)}"
           for d in devices if set(d.clock_events or ()) & set(BAD_CLOCK_EVENTS)]
    hot = [f"{d.label} {d.temperature_c} C (slowdown at {d.slowdown_c} C)" for d in devices
           if d.temperature_c is not None and d.slowdown_c and d.temperature_c >= d.slowdown_c - HOT_MARGIN_C]
    if bad:
        return result(node, FAIL, "clocks slowed at rest: " + "; ".join(bad) +
                      (f"; {'; '.join(hot)}" if hot else ""),
                      "check cooling, fans and the power supply (nvidia-smi -q -d PERFORMANCE,TEMPERATURE)")
    if hot:
        return result(node, WARN, "; ".join(hot), "check cooling before a long run")
    temps = [d.temperature_c for d in devices if d.temperature_c is not None]
    if not temps:
        return result(node, SKIP, "NVML gives no temperature here")
    return result(node, PASS, f"{min(temps)}-{max(temps)} C, no slowdown")


CLOCK_HELD = 0.95   # applications clocks below this share of the maximum hold the GPU back from the first step


CLOCKS_FIX = ("reset them on the node: nvidia-smi -rac (applications clocks) and nvidia-smi -rgc (locked clocks), as "
              "root; nvidia-smi -q -d CLOCK shows them")


def held_clocks(d) -> str | None:
    """How a GPU's clocks are held below its maximum, in words, or None."""
    if d.sm_clock_app_mhz and d.sm_clock_max_mhz and d.sm_clock_app_mhz < CLOCK_HELD * d.sm_clock_max_mhz:
        return f"{d.label} applications clocks {d.sm_clock_app_mhz} of {d.sm_clock_max_mhz} MHz"
    if "applications clocks setting" in (d.clock_events or ()):
        return f"{d.label} clocks set by the applications clocks setting"
    return None


@check("clocks", "gpu", cuda_only=True, section="gpus",
       doc=(("clocks",
            "NVML applications SM clock (what `nvidia-smi -ac` or `-lgc` left) against the GPU's maximum, and the "
            "\"applications clocks setting\" clock event reason",
            "warn when a GPU's clocks are held below 95% of its maximum; fail when its measured bf16 GEMM also fell "
            "below its own past (the clocks keep runs slow)",
            "a GPU held at half its clock passes every other check at rest and runs slow from the first step"),))
def check_clocks(node: str, report: ProbeReport) -> CheckResult:
    """A GPU whose clocks someone set or locked below its maximum (fail-slow from the first step). At rest a
    warning: held_clocks_that_slow (after the GPU job's figures are held to their past) fails the GPU whose GEMM
    fell too."""
    devices = [d for d in report.gpus.read if d.sm_clock_app_mhz and d.sm_clock_max_mhz]
    held = [said for said in map(held_clocks, report.gpus.read) if said]
    if held:
        return result(node, WARN, "clocks held below the maximum: " + "; ".join(held), CLOCKS_FIX)
    if not devices:
        return result(node, SKIP, "NVML gives no applications clocks here")
    tops = sorted({d.sm_clock_max_mhz for d in devices})
    return result(node, PASS, f"applications clocks at their maximum ({'/'.join(map(str, tops))} MHz) on "
                              f"{len(devices)} GPU(s)")


def held_clocks_that_slow(reports: Mapping[str, ProbeReport], fallen) -> list[CheckResult]:
    """A GPU whose clocks are held below the maximum and whose measured bf16 GEMM fell below its own past
    (`fallen`: the (key, metric) of each figure that fell): the clocks keep it slow, a failure, not a warning."""
    out = []
    for node, report in sorted(reports.items()):
        slowed = [said for d in report.gpus.read
                  if (said := held_clocks(d)) and (f"gpu:{d.uuid}", "gemm_tflops") in fallen]
        if slowed:
            out.append(CheckResult("clocks", node, FAIL, "clocks held below the maximum keep the GPU slow (its bf16 "
                                   "GEMM fell below its own past, above): " + "; ".join(slowed), CLOCKS_FIX))
    return out


@check("mig", "gpu", cuda_only=True, section="gpus",
       doc=(("mig",
            "NVML MIG mode (current, pending) and compute mode",
            "fail on MIG enabled or compute mode prohibited; warn on a pending MIG change or an exclusive compute "
            "mode",
            "NCCL cannot join MIG instances of different processes into one job"),))
def check_mig_compute_mode(node: str, report: ProbeReport) -> CheckResult:
    """MIG splits a GPU into instances that NCCL cannot join into one job; a prohibited compute mode forbids any
    CUDA context. A pending MIG change applies only at the next GPU reset."""
    problems, notes = [], []
    for d in report.gpus.read:
        if d.mig_mode == 1:
            problems.append(f"{d.label} has MIG enabled")
        elif d.mig_pending is not None and d.mig_mode is not None and d.mig_pending != d.mig_mode:
            notes.append(f"{d.label} has a MIG change pending (applies at reset)")
        if d.compute_mode == 2:
            problems.append(f"{d.label} compute mode is prohibited")
        elif d.compute_mode in (1, 3):
            notes.append(f"{d.label} compute mode is {COMPUTE_MODES[d.compute_mode]}")
    if problems:
        return result(node, FAIL, "; ".join(problems),
                      "sudo nvidia-smi -i N -mig 0 and reset the GPU; sudo nvidia-smi -i N -c DEFAULT")
    if notes:
        return result(node, WARN, "; ".join(notes),
                      "one rank per GPU works in exclusive-process mode, but nothing else (a debugger, "
                      "a second job) can share it; reset the GPU to apply a pending MIG change")
    if all(d.mig_mode is None and d.compute_mode is None for d in report.gpus.read):
        return result(node, SKIP, "NVML gives no MIG or compute mode here")
    return result(node, PASS, "MIG off, compute mode default")


@check("fabric manager", "gpu", cuda_only=True, section="gpus",
       doc=(("fabric manager",
            "NVML GPU fabric info (state, status)",
            "fail when an NVSwitch system's GPU is not registered (not started, in progress, or an error status); "
            "skip without NVSwitch",
            "CUDA needs the fabric manager before NVLink works on HGX"),))
def check_fabric(node: str, report: ProbeReport) -> CheckResult:
    """On NVSwitch systems (HGX) every GPU must be registered with the fabric (nvidia-fabricmanager) before CUDA
    can use NVLink between GPUs; until then CUDA calls fail or hang."""
    known = [(d, d.fabric) for d in report.gpus.read if d.fabric is not None and d.fabric.state not in (None, 0)]
    if not known:
        return result(node, SKIP, "no NVSwitch fabric (or a driver without the query)")
    bad = [f"{d.label} {FABRIC_STATES.get(f.state, f.state)}" + (f" status {f.status}" if f.status else "")
           for d, f in known if f.state != 3 or f.status]
    if bad:
        return result(node, FAIL, "NVSwitch fabric not ready: " + "; ".join(bad),
                      "systemctl status nvidia-fabricmanager (its version must equal the driver's); "
                      "journalctl -u nvidia-fabricmanager")
    return result(node, PASS, f"{len(known)} GPU(s) registered with the NVSwitch fabric")


@check("xid", "gpu", cuda_only=True,
       doc=(("xid",
            "Xid and SXid lines of the kernel log since boot (`/dev/kmsg`, else `dmesg`, else `journalctl -k`) "
            "mapped to GPUs by PCI address",
            "fail on 48, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140 (reset or drain); warn on any other Xid or SXid; "
            "warn, with the reason, when the log is not readable (Ubuntu's `dmesg_restrict=1` for a non-root login): "
            "a GPU fallen off the bus would show only there",
            "NVIDIA's Xid catalog"),))
def check_xid(node: str, report: ProbeReport) -> CheckResult:
    """Xid (GPU) and SXid (NVSwitch) events in the kernel log since boot."""
    reason = report.unreadable("kernel_events")
    if reason:
        return result(node, SKIP, reason)
    log = report.kernel_events
    if not log.readable:   # a GPU that fell off the bus shows only there: not looking is no pass
        return result(node, WARN, f"the kernel log could not be read, so Xid errors (a GPU fallen off "
                                  f"the bus, ECC, NVLink) were not checked: {log.reason}",
                      "let the login user read it: sysctl kernel.dmesg_restrict=0, or add it to group adm "
                      "(journalctl -k), or log in as root")
    events = log.events
    if not events:
        return result(node, PASS, "no Xid or SXid since boot")
    gpu_at = {(d.pci_bus_id or "").lower()[-12:]: d.label for d in report.gpus.read}

    def where(event):
        pci = event.pci or ""
        return next((name for bus, name in gpu_at.items() if bus and pci and pci[-12:] in bus), pci)

    fatal = [e for e in events if e.kind == "xid" and e.code in RESET_XIDS]
    others = [e for e in events if e not in fatal]
    if fatal:
        named = sorted({f"Xid {e.code} ({RESET_XIDS[e.code]}) on {where(e)}" for e in fatal})
        return result(node, FAIL, "; ".join(named[:6]) + f"; last: {(fatal[-1].text or '')[-120:]}",
                      "reset the GPU (nvidia-smi -r) or reboot, and drain the node if it comes back")
    named = sorted({f"{(e.kind or 'xid').upper().replace('SXID', 'SXid').replace('XID', 'Xid')} {e.code}"
                    f" on {where(e)}" for e in others})
    return result(node, WARN, f"{len(others)} event(s) since boot: " + "; ".join(named[:6]),
                  "application-caused codes (13, 31, 43, 45) follow a crashed job; repeated ones, or any "
                  "SXid, deserve a look at dmesg")


@check("gpudirect", "gpu", cuda_only=True,
       doc=(("gpudirect",
            "`/sys/module/nvidia_peermem` (or `nv_peer_mem`) on GPU nodes with IB",
            "warn when absent",
            "NCCL's GPUDirect RDMA needs it, or DMA-BUF (open modules, NCCL 2.19+)"),))
def check_gpudirect(node: str, report: ProbeReport) -> CheckResult:
    """GPUDirect RDMA lets the NIC read GPU memory directly; without it NCCL stages every message through host
    memory. It needs nvidia_peermem (or, with NCCL 2.19+ and the open kernel modules, DMA-BUF)."""
    if not ib_ports(report) or not report.gpus.read:
        return result(node, SKIP, "needs both GPUs and an InfiniBand/RoCE port")
    if report.unreadable("modules"):
        return result(node, SKIP, report.unreadable("modules"))
    if report.modules.nvidia_peermem or report.modules.nv_peer_mem:
        return result(node, PASS, "nvidia_peermem loaded")
    return result(node, WARN, "nvidia_peermem is not loaded",
                  "sudo modprobe nvidia_peermem (and add it to /etc/modules-load.d); without it NCCL uses "
                  "GPUDirect RDMA only through DMA-BUF (open kernel modules, NCCL 2.19+): check for GDRDMA in "
                  "the collective's NCCL transports")


@check("numa", "gpu", cuda_only=True,
       doc=(("numa",
            "GPU NUMA node (`/sys/bus/pci/devices/<bus>/numa_node`) vs IB devices' `device/numa_node`",
            "warn for GPUs with no NIC on their NUMA node",
            "traffic across the socket link"),))
def check_numa(node: str, report: ProbeReport) -> CheckResult:
    """Each GPU should have an InfiniBand/RoCE NIC on its own NUMA node: traffic to a NIC across the socket
    link halves its bandwidth on most two-socket boards."""
    nics = {d.numa_node for d, _ in ib_ports(report) if d.numa_node is not None and d.numa_node >= 0}
    gpus = [d for d in report.gpus.read if d.numa_node is not None and d.numa_node >= 0]
    if not nics or not gpus:
        return result(node, SKIP, "NUMA nodes of GPUs and NICs not known (one socket, a VM, or no NIC)")
    far = [f"{d.label} (NUMA {d.numa_node})" for d in gpus if d.numa_node not in nics]
    if far:
        return result(node, WARN, f"no NIC on the NUMA node of {', '.join(far)}; NICs on NUMA "
                                  f"{', '.join(map(str, sorted(nics)))}",
                      "check the board's GPU/NIC layout (nvidia-smi topo -m); NCCL picks the nearest NIC, "
                      "but these GPUs cross the socket link")
    return result(node, PASS, f"every GPU has a NIC on its NUMA node ({len(nics)} NUMA node(s))")


def cluster_medians(jobs: Mapping[str, Mapping | None]) -> dict:
    """Per GPU model, the median of each figure over every GPU of the cluster."""
    values: dict = {}
    for node, job in jobs.items():
        for device in (job or {}).get("devices") or []:
            for metric in PERF_FLOOR:
                if isinstance(device.get(metric), (int, float)):
                    values.setdefault((device.get("name"), metric), []).append(device[metric])
    return {key: statistics.median(v) for key, v in values.items()}


@check("gpu perf, gpu load", "gpu", given=lambda f: (f.extras.get("p2p"), f.medians), cuda_only=True, tiers=MEASURED,
       doc=(("gpu perf (default tier)",
            "the GPU job, all GPUs loaded at once: bf16 GEMM TFLOP/s (8192^3, 100 matmuls), HBM copy GB/s (1 GiB, "
            "read + write, 50 copies); then per GPU pinned host-to-device and device-to-host GB/s (256 MiB x 10); "
            "wall clock after `synchronize`",
            "fail for a GPU under 85% (GEMM, HBM) or 70% (host copies) of the median of the node's other GPUs of its "
            "model, or of the cluster's median",
            "healthy GPUs of one model land within a few percent of each other (2 x H200 here: GEMM 725/737, HBM "
            "4242/4227); host copies share PCIe switches, hence the wider margin. Against a plain torch measurement "
            "at its best settings: job GEMM 92%, HBM 98.5%, host copies 100%"),
           ("gpu load (default tier)",
            "NVML sampled every 50 ms during the job: clock event reasons, hottest temperature, PCIe generation "
            "reached",
            "fail on hw slowdown, hw thermal slowdown, hw power brake or sw thermal slowdown; warn when a GPU "
            "reached a lower PCIe generation than the others",
            "NVML clocks event reasons; \"sw power cap\" is a GEMM at its power limit, normal on H100/H200")))
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
