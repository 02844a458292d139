"""The node's hardware while a run runs: Xid events in the kernel log, ECC and row-remap counts, GPUs lost, NVLink and
InfiniBand port error counters. Each is told as its rise since the run started: the first read keeps every counter in
the run folder (hardware.json), every later read (a watch stream's, or one `status`) sets its counters against it.
A counter below its base was reset (a driver reload, a port reset): the base moves down to it, and that is said.

What makes a part unusable is `fatal` (the controller fails the run on it, naming the node and the part): an Xid
NVIDIA's catalogue says needs a reset (48, 62, 64, 74, 79, 95, 119, 120), uncorrectable ECC errors that grew, a row
remap that failed, a GPU of the run lost. What may only slow it (corrected ECC, NVLink replays, port symbol errors)
is named, and the run goes on."""
from __future__ import annotations

import errno
import json
import os
import re
import sys
import time

import runlayout as layout
from runctl.common import read_json, write_file

KMSG = "/dev/kmsg"
INFINIBAND = "/sys/class/infiniband"
EVERY = 5.0          # seconds between two reads in one watch stream (NVML, sysfs, the kernel log: a few ms)
KMSG_LIMIT = 4 << 20  # bytes of the kernel log read at most per look

# NVIDIA's Xid catalogue: what the number means, and whether the GPU needs a reset (the run cannot go on on it).
XIDS = {13: ("graphics engine exception", False), 31: ("GPU memory page fault", False),
        43: ("GPU stopped processing", False), 45: ("preemptive cleanup", False),
        48: ("double-bit ECC error", True), 61: ("internal micro-controller breakpoint", False),
        62: ("internal micro-controller halt", True), 63: ("row remapping recorded (reset to apply)", False),
        64: ("row remapping failed", True), 68: ("video processor exception", False),
        74: ("NVLink error", True), 79: ("GPU has fallen off the bus", True),
        92: ("high single-bit ECC error rate", False), 94: ("contained ECC error", False),
        95: ("uncontained ECC error", True), 119: ("GSP RPC timeout", True), 120: ("GSP error", True)}
XID_RE = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f:.]+)\): (\d+)")
KMSG_RE = re.compile(r"^\d+,(\d+),(\d+),[^;]*;(.*)$")
IDENTITY = ("lost", "pci", "run", "uuid")   # what a part's row says of it, not a counter
PORT_COUNTERS = {"symbol_error": False, "link_error_recovery": False, "link_downed": False,
                 "port_rcv_errors": False, "local_link_integrity_errors": False,
                 "excessive_buffer_overrun_errors": False}
# (counter, fatal when it grows) of each GPU
GPU_COUNTERS = {"ecc_uncorrected": True, "ecc_corrected": False, "remap_uncorrectable": False,
                "remap_failure": True, "nvlink_errors": False}
WORDS = {"ecc_uncorrected": "uncorrectable ECC errors", "ecc_corrected": "corrected ECC errors",
         "remap_uncorrectable": "rows remapped for uncorrectable errors", "remap_failure": "row remap failure",
         "nvlink_errors": "NVLink errors (replay, recovery, CRC)", "symbol_error": "symbol errors",
         "link_error_recovery": "link error recoveries", "link_downed": "link down events",
         "port_rcv_errors": "receive errors", "local_link_integrity_errors": "link integrity errors",
         "excessive_buffer_overrun_errors": "buffer overruns"}

_streams: dict = {}   # run folder -> what one watch stream keeps between reads (its kernel log position, NVML)


def look(run_dir: str, now: float, stream: bool = False) -> dict:
    """{"events": [...], "notes": [...]} of this node since the run started; a stream reads at most every EVERY
    seconds and gives its last answer in between."""
    kept = _streams.get(run_dir) if stream else None
    if kept is not None and now - kept["at"] < EVERY:
        return kept["answer"]
    state = kept or {"xids": {}, "kmsg": None, "said": set()}
    counters, notes = _counters(state, run_dir)
    base_path = os.path.join(run_dir, layout.HARDWARE)
    base = read_json(base_path)
    if not isinstance(base, dict) or not isinstance(base.get("counters"), dict):
        started = _started(run_dir)
        base = {"time": started or now, "counters": {k: v for k, v in counters.items() if k != "_gpus"}}
        _save(base_path, base)
    events, moved = _rises(base, counters, now, notes, _run_gpus(run_dir))
    if moved:
        _save(base_path, base)
    events += _xid_events(state, run_dir, base, notes)
    answer = {"events": events, "notes": notes}
    if stream:
        _streams[run_dir] = {**state, "at": now, "answer": answer}
    elif state.get("kmsg") is not None:
        os.close(state["kmsg"])
    return answer


def baseline(run_dir: str) -> None:
    """The counters when the run starts, kept for every later look (runctl start)."""
    counters, _ = _counters({"xids": {}, "kmsg": None, "said": set()}, run_dir)
    counters.pop("_gpus", None)
    _save(os.path.join(run_dir, layout.HARDWARE), {"time": time.time(), "counters": counters})


def _started(run_dir: str) -> float | None:
    """When the run started on this node (its boot record is written then): Xids from then on are the run's."""
    try:
        return os.stat(os.path.join(run_dir, layout.BOOT)).st_mtime
    except OSError:
        return None


def _save(path: str, base: dict) -> None:
    try:
        write_file(path, json.dumps(base))
    except OSError:
        pass   # a full disk: every read then starts from its own first look, and says nothing risen


def _rises(base: dict, counters: dict, now: float, notes: list, used: set | None) -> tuple[list, bool]:
    """Each counter above its base, as an event of its rise since the run started. A counter below the value last
    seen was reset: what it had risen is carried, and it counts on from its value now. GPUs the base knew that no
    longer answer are lost; what they had risen by at the last look that read them (this watch's, or a `status`
    that ran between two of its reads) is still told with the loss."""
    events, moved, known = [], False, base["counters"]
    last, carried = base.setdefault("last", {}), base.setdefault("carry", {})
    listed = counters.pop("_gpus", None) is not None   # NVML answered: a GPU of the base not listed now is lost
    for part, values in known.items():
        if part.startswith("GPU") and part not in counters and listed:
            counters[part] = {"lost": "no longer listed by NVML (fallen off the bus?)",
                              "run": _of_run(part, values.get("uuid"), used)}
    for part, values in counters.items():
        if values.get("lost") and part in known:
            values = {**known[part], **last.get(part, {}), **values}   # its counters as last read
        if part not in known:
            known[part] = dict(values)   # a part seen for the first time (a port that came up): its base is now
            moved = True
            continue
        for name, value in values.items():
            if name in IDENTITY:
                continue
            was = known[part].get(name)
            if not isinstance(value, int) or not isinstance(was, int):
                if isinstance(value, int):
                    known[part][name], moved = value, True
                continue
            seen = last.setdefault(part, {}).get(name, was)
            carry = carried.setdefault(part, {}).get(name, 0)
            if value < seen:
                notes.append(f"{part}: {WORDS.get(name, name)} went back from {seen} to {value} (a reset): "
                             f"counted on from {value}")
                carry += seen - was
                carried[part][name], known[part][name], was, moved = carry, value, value, True
            if value != seen:
                last[part][name], moved = value, True
            if carry + value - was > 0:
                fatal = (GPU_COUNTERS if part.startswith("GPU") else PORT_COUNTERS).get(name, False)
                events.append({"part": part, "counter": WORDS.get(name, name), "rise": carry + value - was,
                               "now": value, "fatal": bool(fatal and values.get("run", True)), "time": now})
        if values.get("lost") and not known[part].get("lost"):
            events.append({"part": part, "counter": "lost", "rise": 1, "now": None, "time": now,
                           "fatal": bool(values.get("run", True)), "text": values["lost"]})
    return events, moved


def _of_run(part: str, uuid: str | None, used: set | None) -> bool:
    """Whether GPU `part` ("GPU 3") is one of the run's: its index or UUID in CUDA_VISIBLE_DEVICES (all: None)."""
    return used is None or part.split()[-1] in used or (uuid is not None and uuid in used)


def _counters(state: dict, run_dir: str) -> tuple[dict, list]:
    notes: list = []
    counters: dict = {}
    counters.update(_gpu_counters(state, run_dir, notes))
    counters.update(_port_counters(notes))
    return counters, notes


def _run_gpus(run_dir: str) -> set | None:
    """The GPU indices or UUIDs this node's ranks use (its CUDA_VISIBLE_DEVICES), {} on a CPU run, None: all."""
    node = read_json(os.path.join(run_dir, layout.NODE_JSON)) or {}
    if node.get("device") == "cpu":
        return set()
    visible = node.get("cuda_visible")
    if not isinstance(visible, str) or not visible.strip():
        return None
    return {v.strip() for v in visible.split(",") if v.strip()}


def _nvml():
    """nvidia-ml-py's pynvml from this interpreter's site-packages: runctl runs without site (-S), so that no .pth
    file of the node's runs in it; the one module is loaded from there by itself. None where it is not installed."""
    try:
        import pynvml
        return pynvml
    except ImportError:
        pass
    import importlib.machinery
    import importlib.util
    import site

    prefixes = [sys.prefix]
    venv = os.path.dirname(os.path.dirname(os.path.abspath(sys.executable)))   # without site, no venv is set up
    if os.path.isfile(os.path.join(venv, "pyvenv.cfg")):
        prefixes.insert(0, venv)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    folders = [os.path.join(prefix, lib, version, "site-packages") for prefix in prefixes for lib in ("lib", "lib64")]
    folders += site.getsitepackages(prefixes)   # Debian's python names its own dist-packages here, venvs not
    spec = importlib.machinery.PathFinder.find_spec("pynvml", [f for f in folders if os.path.isdir(f)])
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    sys.modules["pynvml"] = module   # it looks itself up there as it loads
    try:
        spec.loader.exec_module(module)
    except Exception:  # noqa: BLE001 - a broken install: no GPU counters, as without it
        del sys.modules["pynvml"]
        return None
    return module


def _gpu_counters(state: dict, run_dir: str, notes: list) -> dict:
    pynvml = _nvml()
    if pynvml is None:
        return {}
    if not state.get("nvml"):
        try:
            pynvml.nvmlInit()
        except Exception:  # noqa: BLE001 - no driver here: a CPU node, nothing to watch
            return {}
        state["nvml"] = True
    try:
        count = pynvml.nvmlDeviceGetCount()
    except Exception as exc:  # noqa: BLE001
        notes.append(f"NVML could not count the GPUs: {exc}")
        return {}
    used = _run_gpus(run_dir)
    out: dict = {"_gpus": {"count": count}}
    for index in range(count):
        part = f"GPU {index}"
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(_call(pynvml.nvmlDeviceGetUUID, handle))
            row = {"pci": _bus(_text(getattr(_call(pynvml.nvmlDeviceGetPciInfo, handle), "busId", ""))),
                   "uuid": uuid, "run": _of_run(part, uuid, used)}
            uncorrected = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
            corrected = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
            row["ecc_uncorrected"] = _call(pynvml.nvmlDeviceGetTotalEccErrors, handle, uncorrected,
                                           pynvml.NVML_VOLATILE_ECC)
            row["ecc_corrected"] = _call(pynvml.nvmlDeviceGetTotalEccErrors, handle, corrected,
                                         pynvml.NVML_VOLATILE_ECC)
            remap = _call(pynvml.nvmlDeviceGetRemappedRows, handle)
            if isinstance(remap, (tuple, list)) and len(remap) >= 4:
                row["remap_uncorrectable"], row["remap_failure"] = int(remap[1]), int(bool(remap[3]))
            row["nvlink_errors"] = _nvlink_errors(pynvml, handle)
        except Exception as exc:  # noqa: BLE001 - GPU_IS_LOST and its kin: the part does not answer
            if "lost" in str(exc).lower() or type(exc).__name__.endswith("GpuIsLost"):
                row = {"lost": f"NVML: {exc}", "run": _of_run(part, None, used)}
            else:
                notes.append(f"{part}: NVML: {exc}")
                continue
        out[part] = row
    return out


def _nvlink_errors(pynvml, handle) -> int | None:
    total, seen = 0, False
    for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) != 1:
                continue
        except Exception:  # noqa: BLE001 - no such link, or no NVLink on this GPU
            break
        for counter in range(4):   # DL replay, DL recovery, CRC flit, CRC data
            value = _call(pynvml.nvmlDeviceGetNvLinkErrorCounter, handle, link, counter)
            if isinstance(value, int):
                total, seen = total + value, True
    return total if seen else None


def _call(function, *args):
    """An NVML query that the GPU may not support: None then. GPU_IS_LOST is raised on."""
    try:
        value = function(*args)
    except Exception as exc:  # noqa: BLE001
        if "lost" in str(exc).lower() or type(exc).__name__.endswith("GpuIsLost"):
            raise
        return None
    return int(value) if isinstance(value, bool) else value


def _text(value) -> str | None:
    return value.decode() if isinstance(value, bytes) else value if isinstance(value, str) else None


def _bus(bus_id: str | None) -> str | None:
    """NVML's "00000000:3B:00.0" and the kernel's "0000:3b:00" as one key: "3b:00" with its domain."""
    if not bus_id:
        return None
    parts = bus_id.lower().split(".")[0].split(":")
    if len(parts) < 2:
        return None
    domain = parts[-3][-4:] if len(parts) >= 3 else "0000"
    return f"{domain.zfill(4)}:{parts[-2]}:{parts[-1]}"


def _port_counters(notes: list) -> dict:
    out: dict = {}
    try:
        devices = sorted(os.listdir(INFINIBAND))
    except OSError:
        return out
    for device in devices:
        ports_dir = os.path.join(INFINIBAND, device, "ports")
        try:
            ports = sorted(os.listdir(ports_dir))
        except OSError:
            continue
        for port in ports:
            row: dict = {}
            for name in PORT_COUNTERS:
                try:
                    with open(os.path.join(ports_dir, port, "counters", name), encoding="utf-8") as handle:
                        row[name] = int(handle.read().strip())
                except (OSError, ValueError):
                    continue
            if row:
                out[f"port {device}/{port}"] = row
    return out


def _xid_events(state: dict, run_dir: str, base: dict, notes: list) -> list:
    """Xid lines of the kernel log since the run started, one event per GPU and Xid: how many, first and last."""
    records = _kernel_log(state, notes)
    if records is None:
        return []
    started_wall = base.get("time", time.time())
    offset = time.time() - time.monotonic()   # the kernel's stamps are CLOCK_MONOTONIC microseconds
    xids = state["xids"]
    gpus = {row.get("pci"): part for part, row in (base.get("counters") or {}).items()
            if isinstance(row, dict) and row.get("pci")}
    used = _run_gpus(run_dir)
    for seq, stamp, text in records:
        found = XID_RE.search(text)
        if not found or seq in state["said"]:
            continue
        state["said"].add(seq)
        when = stamp / 1e6 + offset
        if when < started_wall - 1:
            continue
        pci, code = _bus(found.group(1)), int(found.group(2))
        part = gpus.get(pci) or f"GPU at PCI {found.group(1)}"
        key = (part, code)
        entry = xids.setdefault(key, {"count": 0, "first": when, "text": text.strip()[:300]})
        entry["count"] += 1
        entry["last"] = when
    events = []
    for (part, code), entry in sorted(xids.items(), key=lambda item: item[1]["first"]):
        meaning, reset = XIDS.get(code, ("see NVIDIA's Xid catalogue", False))
        in_run = part.startswith("GPU at") or _of_run(part, None, used)
        events.append({"part": part, "counter": f"Xid {code} ({meaning})", "rise": entry["count"], "now": None,
                       "fatal": bool(reset and in_run), "time": entry["last"], "first": entry["first"],
                       "text": entry["text"]})
    return events


def _kernel_log(state: dict, notes: list) -> list | None:
    """New (seq, microseconds, text) records of the kernel log: a stream keeps its place; a one-shot look reads
    what the kernel still holds. None, said once per look, where it cannot be read (dmesg_restrict, a container)."""
    handle = state.get("kmsg")
    if handle is None:
        try:
            handle = os.open(KMSG, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            notes.append(f"the kernel log ({KMSG}) is not readable here ({exc.strerror or exc}): Xid events are "
                         f"not seen on this node (NODE_SETUP.md: dmesg_restrict)")
            return None
        state["kmsg"] = handle
    records, pending, read = [], b"", 0
    while read < KMSG_LIMIT:
        try:
            chunk = os.read(handle, 8192)
        except OSError as exc:
            if exc.errno == errno.EPIPE:   # records overwritten before we read them: go on from the next
                continue
            if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINVAL):
                break
            notes.append(f"the kernel log ({KMSG}) could not be read: {exc.strerror or exc}")
            break
        if not chunk:
            break
        read += len(chunk)
        pending += chunk
        *lines, rest = pending.split(b"\n")
        pending = rest
        for line in lines:
            found = KMSG_RE.match(line.decode("utf-8", errors="replace"))
            if found:
                records.append((int(found.group(1)), int(found.group(2)), found.group(3)))
    return records


def close(run_dir: str) -> None:
    kept = _streams.pop(run_dir, None)
    if kept and kept.get("kmsg") is not None:
        try:
            os.close(kept["kmsg"])
        except OSError:
            pass
