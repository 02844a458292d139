#!/usr/bin/env python3
"""Node-side probe: prints one JSON report of this machine's facts for env-dump and preflight.

Sent by nodectl to the node's configured python over stdin (`python3 - WORKDIR`), as one script: this file with
launchers/redaction.py's rules in place of its `from redaction import` line (probe_source in
nodectl/remote/probe_nodes.py), so it imports nothing else of nodectl: standard library first; psutil, pynvml
(nvidia-ml-py) and torch only when importable. Each
section runs on its own: a failing section records {"error": ...} under its key and the report still prints.
The environment it reports goes through those rules (docs/REFERENCE.md: secrets never printed or stored).
"""
from __future__ import annotations

import json
import os
import platform
import re
import resource
import socket
import sys
import tempfile
import threading
import time

from redaction import redact_env
from hostsfile import hosts_line   # on a node: replaced by launchers/redaction.py's text (probe_source)


def _section(report: dict, key: str, fn) -> None:
    try:
        report[key] = fn()
    except Exception as exc:  # a probe never fails as a whole
        report[key] = {"error": f"{exc.__class__.__name__}: {exc}"}


def probe_os() -> dict:
    release = {}
    try:
        with open("/etc/os-release", encoding="utf-8") as handle:
            for line in handle:
                key, _, value = line.strip().partition("=")
                if key:
                    release[key] = value.strip('"')
    except OSError:
        pass
    hostname = socket.gethostname()
    return {"hostname": hostname, "system": platform.system(), "kernel": platform.release(),
            "distribution": release.get("PRETTY_NAME", ""), "machine": platform.machine(),
            "hostname_resolves": _resolve(hostname), "hosts_line": hosts_line(hostname)}


def _resolve(name: str, timeout: float = 3.0) -> list | dict:
    """The addresses the node's resolver gives its own host name, in its order (gloo binds the first it can; what
    `hostname -i` and launchers that find "their own address" by name hand the other nodes), or {"error"}; a
    resolver that hangs costs `timeout`."""
    found: dict = {}

    def ask() -> None:
        try:
            found["addresses"] = list(dict.fromkeys(info[4][0] for info in socket.getaddrinfo(name, None)))
        except OSError as exc:
            found["error"] = f"{exc.__class__.__name__}: {exc}"

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(timeout)
    if "addresses" in found:
        return found["addresses"]
    return {"error": found.get("error") or f"the resolver did not answer within {timeout:.0f} s"}


def probe_cpu() -> dict:
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    # The kernel's boot id and the CPUs this login may use: nodes that show the same boot id run on one machine
    # (local "nodes", containers, namespaces) and share the CPUs their sets have in common.
    return {"model": model, "count": os.cpu_count(), "available": len(allowed) if allowed else os.cpu_count(),
            "cpu_set": allowed, "boot_id": _read("/proc/sys/kernel/random/boot_id"),
            "governor": _read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor")}


def probe_memory() -> dict:
    info = {}
    with open("/proc/meminfo", encoding="utf-8") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            info[key] = int(value.split()[0]) * 1024
    overcommit = _read("/proc/sys/vm/overcommit_memory")
    ratio = _read("/proc/sys/vm/overcommit_ratio")
    return {"total_bytes": info.get("MemTotal"), "available_bytes": info.get("MemAvailable"),
            "swap_total_bytes": info.get("SwapTotal"),
            "overcommit_memory": int(overcommit) if overcommit and overcommit.isdigit() else None,
            "overcommit_ratio": int(ratio) if ratio and ratio.isdigit() else None,
            "commit_limit_bytes": info.get("CommitLimit"), "committed_bytes": info.get("Committed_AS")}


def probe_python() -> dict:
    return {"version": platform.python_version(), "executable": sys.executable,
            "implementation": platform.python_implementation(), "prefix": sys.prefix}


def probe_packages() -> dict:
    """Every installed distribution's name and version, read from its metadata's header alone: parsing the whole
    METADATA (long descriptions included) was 190 ms of a 300 ms quick probe."""
    from importlib import metadata

    packages = {}
    for dist in metadata.distributions():
        name, version = _name_and_version(dist)
        if name:
            packages[name.lower().replace("_", "-")] = version
    return dict(sorted(packages.items()))


def _name_and_version(dist) -> tuple:
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
    found = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        if key in ("Name", "Version") and key not in found:
            found[key] = value.strip()
            if len(found) == 2:
                break
    if "Name" not in found:   # a metadata file of another shape: the library's own reading
        return dist.metadata.get("Name"), dist.version
    return found["Name"], found.get("Version")


def _installed(*names: str) -> str | None:
    from importlib import metadata

    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def torch_cuda_of(version_py: str) -> str | None:
    """The CUDA version in the text of torch/version.py (`cuda: Optional[str] = '12.4'`; None for a CPU build)."""
    match = re.search(r"^cuda\s*(?::\s*[^=]+)?=\s*['\"]([^'\"]+)['\"]", version_py, re.M)
    return match[1] if match else None


def probe_torch_metadata() -> dict:
    """torch's versions without importing it (1.5-4 s on a GPU node, most of a quick preflight): torch's own
    version.py gives its CUDA (read as text), the NVIDIA wheels torch depends on give NCCL and cuDNN (None for a
    torch built against system libraries). Importing and CUDA's answer are proven by the default tier."""
    from importlib import metadata

    try:
        dist = metadata.distribution("torch")
    except metadata.PackageNotFoundError:
        return {"error": "ModuleNotFoundError: torch is not installed for this python"}
    try:
        cuda = torch_cuda_of(dist.locate_file("torch/version.py").read_text(encoding="utf-8"))
    except OSError:
        cuda = None
    return {"version": dist.version, "imported": False, "cuda_available": False, "device_count": 0, "cuda": cuda,
            "cudnn": _installed("nvidia-cudnn-cu13", "nvidia-cudnn-cu12", "nvidia-cudnn-cu11"),
            "nccl": _installed("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")}


def probe_torch() -> dict:
    import torch

    info = {"version": torch.__version__, "imported": True, "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None),
            "cuda_available": torch.cuda.is_available(), "device_count": 0, "cudnn": None, "nccl": None,
            "distributed": torch.distributed.is_available()}
    if torch.distributed.is_available():
        info["nccl_available"] = torch.distributed.is_nccl_available()
        info["gloo_available"] = torch.distributed.is_gloo_available()
    if torch.cuda.is_available():
        info["device_count"] = torch.cuda.device_count()
        info["cudnn"] = torch.backends.cudnn.version()
        try:
            nccl = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        except Exception as exc:
            info["nccl"] = f"unknown ({exc})"
        info["devices"] = [{"name": torch.cuda.get_device_name(i),
                            "capability": ".".join(map(str, torch.cuda.get_device_capability(i)))}
                           for i in range(info["device_count"])]
    return info


def _user_of(pid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(os.stat(f"/proc/{pid}").st_uid).pw_name
    except Exception:
        return "?"


def _nvml_call(fn, *args, default=None):
    try:
        return fn(*args)
    except Exception:
        return default


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


def probe_gpus() -> dict:
    try:
        import pynvml
    except ImportError:
        return {"available": False, "reason": "nvidia-ml-py is not installed", "count": 0, "devices": []}
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        return {"available": False, "reason": f"NVML: {exc}", "count": 0, "devices": []}
    try:
        count = pynvml.nvmlDeviceGetCount()
        devices = [_gpu_or_error(pynvml, index) for index in range(count)]
        driver = pynvml.nvmlSystemGetDriverVersion()
        cuda = _nvml_call(pynvml.nvmlSystemGetCudaDriverVersion)
        report = {"available": True, "count": count, "driver": driver.decode() if isinstance(driver, bytes) else driver,
                  "cuda_driver": f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else None, "devices": devices}
        return {**report, **visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), devices)}
    finally:
        pynvml.nvmlShutdown()


def visible_devices(spec, devices: list) -> dict:
    """What CUDA_VISIBLE_DEVICES leaves of NVML's devices (NVML ignores it; the ranks will not): the report's
    `devices` and `count` become the visible ones, `count_all` keeps the node's total. Entries are indexes or
    (prefixes of) GPU UUIDs; like CUDA, the list ends at the first entry that names no GPU, which is reported
    in `unresolved` with whatever it hid."""
    if spec is None:
        return {}
    chosen, unresolved = [], []
    entries = [e.strip() for e in spec.split(",")] if spec.strip() else []
    for position, entry in enumerate(entries):
        if entry.isdigit():
            match = [d for d in devices if d.get("index") == int(entry)]
        elif entry.startswith(("GPU-", "MIG-")):
            match = [d for d in devices if str(d.get("uuid") or "").startswith(entry)]
        else:
            match = []
        if len(match) != 1 or match[0] in chosen:
            unresolved = entries[position:]
            break
        chosen.append(match[0])
    return {"visible": spec, "count_all": len(devices), "count": len(chosen), "devices": chosen,
            "unresolved": unresolved}


def _gpu_or_error(pynvml, index: int) -> dict:
    """One GPU's facts, or why they could not be read ({"index", "error"}): a GPU that fell off the bus must not
    take the other GPUs' facts (and checks) with it."""
    try:
        return _gpu(pynvml, index)
    except Exception as exc:   # NVMLError_GpuIsLost, Unknown Error, ...
        return {"index": index, "error": f"{exc.__class__.__name__}: {exc}"}


def _gpu(pynvml, index: int) -> dict:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    name = pynvml.nvmlDeviceGetName(handle)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    ecc_current = _nvml_call(lambda: pynvml.nvmlDeviceGetEccMode(handle)[0])
    processes = []
    for proc in _nvml_call(pynvml.nvmlDeviceGetComputeRunningProcesses, handle, default=[]) or []:
        processes.append({"pid": proc.pid, "user": _user_of(proc.pid),
                          "used_bytes": getattr(proc, "usedGpuMemory", None)})
    nvlinks = []
    for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
        state = _nvml_call(pynvml.nvmlDeviceGetNvLinkState, handle, link)
        if state is None:
            break
        nvlinks.append(bool(state))
    remap = _nvml_call(pynvml.nvmlDeviceGetRemappedRows, handle)
    bus_id = _text(_nvml_call(lambda: pynvml.nvmlDeviceGetPciInfo(handle).busId))
    return {**_gpu_health(pynvml, handle, len(nvlinks)), "numa_node": _pci_numa(bus_id),
        "index": index, "name": name.decode() if isinstance(name, bytes) else name,
        "uuid": _nvml_call(pynvml.nvmlDeviceGetUUID, handle),
        "pci_bus_id": _nvml_call(lambda: pynvml.nvmlDeviceGetPciInfo(handle).busId),
        "memory_total_bytes": memory.total, "memory_used_bytes": memory.used,
        "persistence_mode": _nvml_call(pynvml.nvmlDeviceGetPersistenceMode, handle) == 1,
        "ecc_enabled": None if ecc_current is None else ecc_current == 1,
        "ecc_volatile_uncorrected": _nvml_call(
            pynvml.nvmlDeviceGetTotalEccErrors, handle, 1, 0),  # UNCORRECTED, VOLATILE
        "retired_pages_pending": _nvml_call(lambda: pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle) == 1),
        "remapped_rows_pending": None if remap is None else bool(remap[2]),
        "remapped_rows_failed": None if remap is None else bool(remap[3]),
        "nvlinks_active": sum(nvlinks), "nvlinks": len(nvlinks),
        "vbios": _text(_nvml_call(pynvml.nvmlDeviceGetVbiosVersion, handle)),
        "compute_processes": processes,
    }


CLOCK_EVENT_BITS = {0x1: "gpu idle", 0x2: "applications clocks setting", 0x4: "sw power cap", 0x8: "hw slowdown",
                    0x10: "sync boost", 0x20: "sw thermal slowdown", 0x40: "hw thermal slowdown",
                    0x80: "hw power brake", 0x100: "display clock setting", 0x200: "board limit",
                    0x400: "reliability"}   # every reason NVML names (nvmlClocksEventReasons)
NVML_CLOCK_SM = 1
NVLINK_ERROR_FIELDS = {"crc_flit": 160, "crc_data": 161, "replay": 162, "recovery": 163}  # NVML_FI_DEV_NVLINK_*_TOTAL


def clock_events(mask) -> list | None:
    """NVML's clocks event (throttle) reasons bitmask as names."""
    if mask is None:
        return None
    return [name for bit, name in CLOCK_EVENT_BITS.items() if mask & bit]


def _fabric(pynvml, handle) -> dict | None:
    """NVSwitch fabric registration (Hopper and later): None where NVML has no such call (older driver)."""
    try:
        info = pynvml.c_nvmlGpuFabricInfo_t()
        pynvml.nvmlDeviceGetGpuFabricInfo(handle, pynvml.byref(info))
    except Exception as exc:
        return {"error": str(exc)} if "Not Supported" not in str(exc) else {"state": 0}
    return {"state": info.state, "status": info.status}


def _nvlink_errors(pynvml, handle, links: int) -> dict | None:
    if not links:
        return None
    try:
        values = pynvml.nvmlDeviceGetFieldValues(handle, list(NVLINK_ERROR_FIELDS.values()))
    except Exception:
        return None
    out = {}
    for name, value in zip(NVLINK_ERROR_FIELDS, values):
        if value.nvmlReturn == 0:
            out[name] = int(value.value.ullVal)
    return out or None


def _gpu_health(pynvml, handle, links: int) -> dict:
    """What preflight reads of a GPU's health without loading it: PCIe link, clock events, temperature against
    its slowdown threshold, MIG and compute mode, NVSwitch fabric state, NVLink error counters. A fact NVML
    cannot give is None (the check skips it)."""
    mig = _nvml_call(pynvml.nvmlDeviceGetMigMode, handle)
    return {
        "pcie_gen": _nvml_call(pynvml.nvmlDeviceGetCurrPcieLinkGeneration, handle),
        "pcie_gen_max": _nvml_call(pynvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
        "pcie_width": _nvml_call(pynvml.nvmlDeviceGetCurrPcieLinkWidth, handle),
        "pcie_width_max": _nvml_call(pynvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
        "clock_events": clock_events(_nvml_call(pynvml.nvmlDeviceGetCurrentClocksEventReasons, handle)),
        # the SM clock the applications clocks (or clocks locked with nvidia-smi -lgc) allow, against its maximum
        "sm_clock_app_mhz": _nvml_call(pynvml.nvmlDeviceGetApplicationsClock, handle, NVML_CLOCK_SM),
        "sm_clock_max_mhz": _nvml_call(pynvml.nvmlDeviceGetMaxClockInfo, handle, NVML_CLOCK_SM),
        "temperature_c": _nvml_call(pynvml.nvmlDeviceGetTemperature, handle, 0),  # NVML_TEMPERATURE_GPU
        "slowdown_c": _nvml_call(pynvml.nvmlDeviceGetTemperatureThreshold, handle, 1),  # ..._SLOWDOWN
        "mig_mode": None if mig is None else mig[0], "mig_pending": None if mig is None else mig[1],
        "compute_mode": _nvml_call(pynvml.nvmlDeviceGetComputeMode, handle),
        "fabric": _fabric(pynvml, handle),
        "nvlink_errors": _nvlink_errors(pynvml, handle, links),
    }


def _pci_numa(bus_id) -> int | None:
    """The NUMA node of a PCI device from sysfs (NVML's bus id has 8 hex digits of domain; sysfs 4)."""
    if not bus_id:
        return None
    domain, _, rest = bus_id.lower().partition(":")
    value = _read(f"/sys/bus/pci/devices/{domain[-4:]}:{rest}/numa_node")
    return int(value) if value and value.lstrip("-").isdigit() else None


XID = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F:.]+)\): (\d+)")
SXID = re.compile(r"SXid \(PCI:([0-9a-fA-F:.]+)\): (\d+)")


def _kernel_log() -> tuple:
    """The kernel ring buffer's lines since boot, or (None, why not): /dev/kmsg where readable (root, or
    dmesg_restrict=0), else `dmesg`, else journald's kernel log."""
    import subprocess

    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        reason = f"/dev/kmsg: {exc.strerror}"
    else:
        lines = []
        try:
            while True:
                try:
                    record = os.read(fd, 8192)
                except BlockingIOError:
                    break
                except OSError:  # EPIPE: a record was overwritten while reading; go on
                    continue
                if not record:
                    break
                lines.append(record.decode(errors="replace").split(";", 1)[-1].strip())
        finally:
            os.close(fd)
        return lines, None
    for argv in (["dmesg"], ["journalctl", "-k", "-b", "--no-pager", "-o", "cat"]):
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as exc:
            reason += f"; {argv[0]}: {exc}"
            continue
        if proc.returncode == 0 and proc.stdout.strip():
            return proc.stdout.splitlines(), None
        reason += f"; {argv[0]}: {(proc.stderr.strip() or 'no output').splitlines()[-1][:120]}"
    return None, reason


def parse_xids(lines) -> list:
    """Xid (GPU) and SXid (NVSwitch) events of the kernel log: code, PCI address, the line (cut)."""
    events = []
    for line in lines:
        for pattern, kind in ((XID, "xid"), (SXID, "sxid")):
            match = pattern.search(line)
            if match:
                events.append({"kind": kind, "pci": match[1].lower(), "code": int(match[2]), "text": line[-200:]})
                break
    return events


def probe_kernel_events() -> dict:
    lines, reason = _kernel_log()
    if lines is None:
        return {"readable": False, "reason": reason}
    return {"readable": True, "events": parse_xids(lines)[-200:]}


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read().strip()
    except OSError:
        return None


def probe_nics() -> list:
    addresses: dict = {}
    try:
        import psutil

        for name, addrs in psutil.net_if_addrs().items():
            addresses[name] = [a.address for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
    except ImportError:
        pass
    nics = []
    for name in sorted(os.listdir("/sys/class/net")):
        base = f"/sys/class/net/{name}"
        speed = _read(f"{base}/speed")
        nics.append({"name": name, "addresses": addresses.get(name, []), "mtu": int(_read(f"{base}/mtu") or 0),
                     "state": _read(f"{base}/operstate"),
                     "speed_mbps": int(speed) if speed and speed.lstrip("-").isdigit() and int(speed) > 0 else None,
                     "virtual": os.path.realpath(base).startswith("/sys/devices/virtual")})
    return nics


def probe_infiniband() -> list:
    root = "/sys/class/infiniband"
    devices = []
    if not os.path.isdir(root):
        return devices
    for device in sorted(os.listdir(root)):
        ports = []
        ports_dir = f"{root}/{device}/ports"
        for port in sorted(os.listdir(ports_dir)) if os.path.isdir(ports_dir) else []:
            base = f"{ports_dir}/{port}"
            ports.append({"port": int(port), "state": _read(f"{base}/state"), "phys_state": _read(f"{base}/phys_state"),
                          "rate": _read(f"{base}/rate"), "link_layer": _read(f"{base}/link_layer"),
                          "counters": _ib_counters(f"{base}/counters")})
        numa = _read(f"{root}/{device}/device/numa_node")
        devices.append({"name": device, "ports": ports, "fw_ver": _read(f"{root}/{device}/fw_ver"),
                        "driver_version": _read("/sys/module/mlx5_core/version"),
                        "numa_node": int(numa) if numa and numa.lstrip("-").isdigit() else None})
    return devices


IB_ERROR_COUNTERS = ("symbol_error", "link_error_recovery", "link_downed", "port_rcv_errors",
                     "local_link_integrity_errors", "excessive_buffer_overrun_errors", "port_rcv_remote_physical_errors")


def _ib_counters(folder: str) -> dict:
    values = {name: _read(f"{folder}/{name}") for name in IB_ERROR_COUNTERS}
    return {name: int(v) for name, v in values.items() if v is not None and v.isdigit()}


def probe_modules() -> dict:
    """Kernel modules that decide GPUDirect RDMA: nvidia_peermem (or the older nv_peer_mem)."""
    return {name: os.path.isdir(f"/sys/module/{name}") for name in ("nvidia_peermem", "nv_peer_mem", "nvidia")}


def _limit(value: int):
    return "unlimited" if value == resource.RLIM_INFINITY else value


def probe_limits() -> dict:
    memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)
    return {"memlock_soft": _limit(memlock[0]), "memlock_hard": _limit(memlock[1]),
            "nofile_soft": _limit(nofile[0]), "nofile_hard": _limit(nofile[1]),
            "nproc_soft": _limit(nproc[0]), "nproc_hard": _limit(nproc[1]), "pids_max": _pids_max()}


def probe_cgroup() -> dict:
    """The limits of the cgroup this login runs in, which the ranks inherit: memory (v2 memory.max, v1
    memory.limit_in_bytes), CPU quota (v2 cpu.max, v1 cpu.cfs_quota_us / cfs_period_us) and pids, each the
    tightest along the path to the root, with the file it was read from. /proc/meminfo and os.cpu_count() show
    the machine, not what a process in here may use."""
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as handle:
            lines = [line.strip().split(":", 2) for line in handle if line.strip()]
    except OSError as exc:
        return {"error": f"/proc/self/cgroup: {exc.strerror}"}
    unified = "/sys/fs/cgroup" if os.path.exists("/sys/fs/cgroup/cgroup.controllers") else "/sys/fs/cgroup/unified"
    found = {"version": 2 if unified == "/sys/fs/cgroup" else 1}
    for _, controllers, path in lines:
        names = controllers.split(",") if controllers else []
        if not controllers:   # the v2 (unified) hierarchy: all of it, or (hybrid) beside the v1 controllers
            _tightest(found, "memory", unified, path, "memory.max", _bytes_limit)
            _tightest(found, "cpu", unified, path, "cpu.max", _cpu_v2)
            _tightest(found, "pids", unified, path, "pids.max", _count_limit)
        if "memory" in names:
            _tightest(found, "memory", "/sys/fs/cgroup/memory", path, "memory.limit_in_bytes", _bytes_limit)
        if "cpu" in names:
            folder = next((f"/sys/fs/cgroup/{n}" for n in ("cpu,cpuacct", "cpu") if os.path.isdir(f"/sys/fs/cgroup/{n}")),
                          "/sys/fs/cgroup/cpu")
            _tightest(found, "cpu", folder, path, "cpu.cfs_quota_us", _cpu_v1)
        if "pids" in names:
            _tightest(found, "pids", "/sys/fs/cgroup/pids", path, "pids.max", _count_limit)
    return found


def _tightest(found: dict, what: str, root: str, path: str, name: str, parse) -> None:
    """The lowest limit `name` on the way from `root`+`path` up to `root` into found[what] ({"limit", "file"})."""
    path = path if path.startswith("/") else "/" + path
    while True:
        file = os.path.join(root + path.rstrip("/"), name)
        value = parse(file)
        if value is not None and (what not in found or value < found[what]["limit"]):
            found[what] = {"limit": value, "file": file}
        if path in ("/", ""):
            return
        path = os.path.dirname(path.rstrip("/")) or "/"


def _bytes_limit(file: str):
    text = _read(file)
    if not text or not text.isdigit():
        return None   # "max", missing or unreadable: no limit here
    value = int(text)
    return value if value < (1 << 60) else None   # v1's "unlimited" is a page-rounded 2**63


def _count_limit(file: str):
    text = _read(file)
    return int(text) if text and text.isdigit() else None


def _cpu_v2(file: str):
    words = (_read(file) or "").split()
    if len(words) == 2 and words[0].isdigit() and words[1].isdigit() and int(words[1]):
        return round(int(words[0]) / int(words[1]), 2)   # CPUs' worth of time
    return None


def _cpu_v1(file: str):
    quota = _read(file)
    period = _read(file.replace("cfs_quota_us", "cfs_period_us"))
    if quota and period and quota.lstrip("-").isdigit() and period.isdigit() and int(quota) > 0 and int(period):
        return round(int(quota) / int(period), 2)
    return None


def _pids_max():
    """The pids cgroup's limit on this session's tasks (threads count): "max", a number, or None unreadable."""
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":   # cgroup v2
            candidate = f"/sys/fs/cgroup{path}/pids.max"
        elif "pids" in controllers.split(","):
            candidate = f"/sys/fs/cgroup/pids{path}/pids.max"
        else:
            continue
        value = _read(candidate)
        if value:
            return value if value == "max" else int(value) if value.isdigit() else None
    return None


def probe_disk(workdir: str) -> dict:
    path = os.path.expanduser(workdir)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    stat = os.statvfs(path)
    shm = os.statvfs("/dev/shm") if os.path.exists("/dev/shm") else None
    return {"workdir": os.path.expanduser(workdir), "checked_path": path, "free_bytes": stat.f_bavail * stat.f_frsize,
            **_inodes(path, stat),
            "shm_bytes": shm.f_blocks * shm.f_frsize if shm else None, **_try_write(os.path.expanduser(workdir)),
            "unsafe": _unsafe(os.path.expanduser(workdir)),
            "scratch": {"tmp": _scratch(os.environ.get("TMPDIR") or "/tmp"),
                        "cache": _scratch(os.environ.get("HF_HOME") or os.environ.get("XDG_CACHE_HOME")
                                          or os.path.expanduser("~/.cache"))}}


def _inodes(path: str, stat) -> dict:
    """Free and total inodes of the file system holding `path` (0 total: one that does not count them, btrfs
    say), and its mount point: a disk out of inodes refuses new files with ENOSPC while it still has bytes."""
    mount = os.path.realpath(path)
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    return {"free_inodes": stat.f_favail, "total_inodes": stat.f_files, "mount": mount}


def _unsafe(workdir: str):
    """runctl's node-side trust rule, read (nothing made): {"path", "why"} of the first folder it would refuse
    (a workdir another user owns, or others may write without the sticky bit; a .nodectl or runs that is a link,
    or another user's), or None."""
    import stat as modes

    uid = os.getuid()
    found = _unsafe_path(workdir, uid)
    if found:
        return found
    try:
        info = os.stat(workdir)
    except OSError:
        return None
    if info.st_uid not in (uid, 0):
        return {"path": workdir, "why": f"owned by uid {info.st_uid}, not by you (uid {uid}) or root"}
    if info.st_mode & 0o022 and not info.st_mode & modes.S_ISVTX:
        return {"path": workdir, "why": "writable by other users without the sticky bit"}
    for name in (".nodectl", "runs"):
        path = os.path.join(workdir, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if modes.S_ISLNK(info.st_mode):
            return {"path": path, "why": f"a symbolic link (to {os.readlink(path)}), not a folder nodectl made"}
        if info.st_uid != uid:
            return {"path": path, "why": f"owned by uid {info.st_uid}, not by you (uid {uid}): another user made it"}
    return None


def _unsafe_path(path: str, uid: int):
    """The first folder or link on the way to `path` that another user owns (they choose where it leads), or a
    folder others may write without the sticky bit: runctl's StrictModes rule (resolve_workdir), read only."""
    import stat as modes

    pending, current, hops = [p for p in os.path.abspath(path).split("/") if p], "/", 0
    while pending and hops <= 40:
        name = pending.pop(0)
        if name in (".", ".."):
            current = os.path.dirname(current) if name == ".." else current
            continue
        candidate = os.path.join(current, name)
        try:
            info = os.lstat(candidate)
        except OSError:
            return None
        is_link = modes.S_ISLNK(info.st_mode)
        if info.st_uid not in (uid, 0):
            what = f"a symbolic link (to {os.readlink(candidate)})" if is_link else "a folder"
            return {"path": candidate, "why": f"{what} owned by uid {info.st_uid}, not by you (uid {uid}) or root"}
        if is_link:
            hops += 1
            target = os.readlink(candidate)
            pending[:0] = [p for p in target.split("/") if p]
            current = "/" if target.startswith("/") else current
            continue
        if pending and info.st_mode & 0o022 and not info.st_mode & modes.S_ISVTX:
            return {"path": candidate, "why": "writable by other users without the sticky bit, on the way to the "
                                              "workdir"}
        current = candidate
    return None


def _scratch(folder: str) -> dict:
    """A folder ranks write to behind the program's back (torch.compile and Triton in the temp folder, Hugging
    Face and Triton caches under ~/.cache): writable with room for a file (a full disk still makes an empty
    one), and its free space. The temp folder is $TMPDIR, else /tmp, as gcc, ptxas, mktemp and Triton take it:
    not tempfile.gettempdir(), which passes over a full /tmp to /var/tmp where none of them write."""
    found = {"path": folder, **_try_write(folder, SCRATCH_PROOF)}
    try:
        there = found.get("exists_from", folder)
        stat = os.statvfs(there)
        found["free_bytes"] = stat.f_bavail * stat.f_frsize
        found.update(_inodes(there, stat))
    except OSError:
        pass
    return found


SCRATCH_PROOF = 1 << 20   # bytes written (and flushed to the file system) to prove a scratch folder has room


def _try_write(folder: str, size: int = 0) -> dict:
    """Whether files can be written in `folder`: a file made there, `size` bytes long and flushed (so a full file
    system says so), and removed. Preflight makes nothing the user named: a folder that does not exist is reported
    missing (`missing`), with the folder above it that does (`exists_from`), tried in its place: the launch (a
    workdir) or the library (a cache) would make it there. A TMPDIR under a scratch mount that is not there stays
    absent, instead of appearing on the root disk and hiding the missing mount."""
    found: dict = {}
    if not os.path.isdir(folder):
        above = os.path.dirname(os.path.abspath(folder))
        while not os.path.isdir(above) and os.path.dirname(above) != above:
            above = os.path.dirname(above)
        found, folder = {"missing": True, "exists_from": above}, above
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".nodectl-write-test-") as handle:
            if size:
                handle.write(b"\0" * size)
                handle.flush()
                os.fsync(handle.fileno())
        return {**found, "writable": True}
    except OSError as exc:
        return {**found, "writable": False, "write_error": f"{exc.__class__.__name__}: {exc.strerror or exc}"}


def _has_gpu_device() -> bool:
    return any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/kfd"))


def probe(workdir: str = "~", import_torch: bool | None = None) -> dict:
    """import_torch: True always imports torch (preflight proves it imports), False never, None where a GPU
    device node exists (CUDA, cuDNN and NCCL versions need the import; on a CPU node metadata suffices)."""
    started = time.time()
    report: dict = {"probe_version": 1}
    if import_torch is None:
        import_torch = _has_gpu_device()
    torch_probe = probe_torch if import_torch else probe_torch_metadata
    torch_thread = threading.Thread(target=_section, args=(report, "torch", torch_probe), daemon=True)
    torch_thread.start()  # importing torch is the slow part; everything else runs beside it
    for key, fn in (("os", probe_os), ("cpu", probe_cpu), ("memory", probe_memory), ("python", probe_python),
                    ("packages", probe_packages), ("gpus", probe_gpus), ("nics", probe_nics),
                    ("infiniband", probe_infiniband), ("modules", probe_modules), ("kernel_events", probe_kernel_events),
                    ("limits", probe_limits), ("cgroup", probe_cgroup), ("disk", lambda: probe_disk(workdir)),
                    ("env", lambda: redact_env(dict(os.environ)))):
        _section(report, key, fn)
    torch_thread.join(timeout=60)
    if "torch" not in report:
        report["torch"] = {"error": "TimeoutError: importing torch took over 60 s"}
    report["clock"] = {"time": time.time(), "timezone": time.strftime("%Z")}
    report["elapsed_s"] = round(time.time() - started, 3)
    return report


if __name__ == "__main__":
    flags = set(sys.argv[2:])
    choice = True if "--import-torch" in flags else False if "--no-import-torch" in flags else None
    print(json.dumps(probe(sys.argv[1] if len(sys.argv) > 1 else "~", choice), default=str))
