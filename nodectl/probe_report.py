"""A node's probe report (launchers/probe.py) as typed sections, parsed once where its readers receive it
(preflight/run.py builds each node's `NodeFacts` from it; plan.py reads its CPUs, GPUs and torch): the checks
read `report.gpus.devices[0].pcie_width`, never a key path. The parse keeps each value of its declared type and drops any other (a node answers what it answers: a
string where a count belongs reads as unknown, None, as a missing key did), so a check has one question left:
known or not. The report as the node sent it stays in `raw`, which the records, the cache and env-dump keep.
"""
from __future__ import annotations

import functools
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, Mapping

_BAD = object()


def _value(kind: Any, value: Any) -> Any:
    """`value` if it is of `kind` (a parsed dataclass for a dataclass kind, a tuple for tuple[X, ...]), else _BAD."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None if type(None) in typing.get_args(kind) else _BAD
        for member in typing.get_args(kind):
            got = _value(member, value) if member is not type(None) else _BAD
            if got is not _BAD:
                return got
        return _BAD
    if kind is Any:
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            return _BAD
        items = (_value(typing.get_args(kind)[0], v) for v in value)
        return tuple(v for v in items if v is not _BAD)
    if origin in (Mapping, dict) or kind in (Mapping, dict):
        return value if isinstance(value, Mapping) else _BAD
    if is_dataclass(kind):
        return parse(kind, value) if isinstance(value, Mapping) else _BAD
    if kind is bool:
        return value if isinstance(value, bool) else _BAD
    if kind is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _BAD
    if kind is float:
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else _BAD
    if kind is str:
        return value if isinstance(value, str) else _BAD
    raise TypeError(f"facts.py: no parse for {kind!r}")


@functools.cache
def _hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


def parse(cls: type, raw: Any):
    """`cls` (a dataclass) from a mapping: each field from its key when of its type, else its default."""
    raw = raw if isinstance(raw, Mapping) else {}
    hints, values = _hints(cls), {}
    for f in fields(cls):
        if f.name in raw:
            got = _value(hints[f.name], raw[f.name])
            if got is not _BAD:
                values[f.name] = got
    return cls(**values)


@dataclass(frozen=True)
class Section:
    error: str | None = None   # why the probe could not read this section


@dataclass(frozen=True)
class HostsLine:
    line: int | None = None
    text: str | None = None


@dataclass(frozen=True)
class Os(Section):
    hostname: str | None = None
    system: str | None = None
    kernel: str | None = None
    distribution: str | None = None
    machine: str | None = None
    hostname_resolves: tuple[str, ...] | Mapping | None = None   # the addresses, or {"error"} when none
    hosts_line: HostsLine | None = None


@dataclass(frozen=True)
class Cpu(Section):
    model: str | None = None
    count: int | None = None
    available: int | None = None
    cpu_set: tuple[int, ...] | None = None   # the CPU ids this login may run on
    boot_id: str | None = None               # the kernel's: one machine's nodes share it
    governor: str | None = None


@dataclass(frozen=True)
class Memory(Section):
    total_bytes: int | None = None
    available_bytes: int | None = None
    swap_total_bytes: int | None = None
    overcommit_memory: int | None = None
    overcommit_ratio: int | None = None
    commit_limit_bytes: int | None = None
    committed_bytes: int | None = None


@dataclass(frozen=True)
class Python(Section):
    version: str | None = None
    executable: str | None = None
    implementation: str | None = None
    prefix: str | None = None


@dataclass(frozen=True)
class Torch(Section):
    version: str | None = None
    imported: bool | None = None
    cuda: str | None = None
    hip: str | None = None
    cuda_available: bool | None = None
    device_count: int | None = None
    cudnn: int | str | None = None
    nccl: str | None = None
    distributed: bool | None = None
    nccl_available: bool | None = None
    gloo_available: bool | None = None


@dataclass(frozen=True)
class GpuProcess:
    pid: int | None = None
    user: str | None = None
    used_bytes: int | None = None


@dataclass(frozen=True)
class Fabric(Section):
    state: int | None = None
    status: int | None = None


@dataclass(frozen=True)
class GpuDevice(Section):
    """One GPU as NVML gave it; `error` when it could not be read (a GPU fallen off the bus)."""
    index: int | None = None
    name: str | None = None
    uuid: str | None = None
    pci_bus_id: str | None = None
    numa_node: int | None = None
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    persistence_mode: bool | None = None
    ecc_enabled: bool | None = None
    ecc_volatile_uncorrected: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failed: bool | None = None
    nvlinks_active: int | None = None
    nvlinks: int | None = None
    vbios: str | None = None
    compute_processes: tuple[GpuProcess, ...] = ()
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    clock_events: tuple[str, ...] | None = None
    sm_clock_app_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    temperature_c: int | None = None
    slowdown_c: int | None = None
    mig_mode: int | None = None
    mig_pending: int | None = None
    compute_mode: int | None = None
    fabric: Fabric | None = None
    nvlink_errors: Mapping | None = None

    @property
    def label(self) -> str:
        return f"GPU{self.index if self.index is not None else '?'}"


@dataclass(frozen=True)
class Gpus(Section):
    available: bool | None = None
    reason: str | None = None
    count: int | None = None
    count_all: int | None = None
    driver: str | None = None
    cuda_driver: str | None = None
    devices: tuple[GpuDevice, ...] = ()
    visible: str | None = None          # CUDA_VISIBLE_DEVICES as the ranks get it (None: not set)
    unresolved: tuple[str, ...] = ()    # its entries from the first that names no GPU

    @property
    def read(self) -> tuple[GpuDevice, ...]:
        """The GPUs whose facts were read (one that could not be is check_gpu_count's failure, and leaves the
        other GPUs' checks standing)."""
        return tuple(d for d in self.devices if d.error is None)

    @property
    def lost(self) -> tuple[GpuDevice, ...]:
        return tuple(d for d in self.devices if d.error is not None)


@dataclass(frozen=True)
class Nic:
    name: str | None = None
    addresses: tuple[str, ...] = ()
    mtu: int | None = None
    state: str | None = None
    speed_mbps: int | None = None
    virtual: bool | None = None


@dataclass(frozen=True)
class IbPort:
    port: int | None = None
    state: str | None = None
    phys_state: str | None = None
    rate: str | None = None
    link_layer: str | None = None
    counters: Mapping | None = None


@dataclass(frozen=True)
class IbDevice:
    name: str | None = None
    ports: tuple[IbPort, ...] = ()
    fw_ver: str | None = None
    driver_version: str | None = None
    numa_node: int | None = None


@dataclass(frozen=True)
class Modules(Section):
    nvidia_peermem: bool | None = None
    nv_peer_mem: bool | None = None
    nvidia: bool | None = None


@dataclass(frozen=True)
class KernelEvent:
    kind: str | None = None
    code: int | None = None
    pci: str | None = None
    text: str | None = None


@dataclass(frozen=True)
class KernelEvents(Section):
    readable: bool | None = None
    reason: str | None = None
    events: tuple[KernelEvent, ...] = ()


@dataclass(frozen=True)
class Limits(Section):
    memlock_soft: int | str | None = None    # a number, or "unlimited"
    memlock_hard: int | str | None = None
    nofile_soft: int | str | None = None
    nofile_hard: int | str | None = None
    nproc_soft: int | str | None = None
    nproc_hard: int | str | None = None
    pids_max: int | str | None = None        # a number, or "max"


@dataclass(frozen=True)
class CgroupLimit:
    limit: int | float | None = None
    file: str | None = None


@dataclass(frozen=True)
class Cgroup(Section):
    version: int | None = None
    memory: CgroupLimit = CgroupLimit()
    cpu: CgroupLimit = CgroupLimit()
    pids: CgroupLimit = CgroupLimit()


@dataclass(frozen=True)
class Unsafe:
    path: str | None = None
    why: str | None = None


@dataclass(frozen=True)
class Space:
    """A folder's file system: free bytes and inodes, its mount point; whether a test write there succeeded."""
    path: str | None = None
    writable: bool | None = None
    write_error: str | None = None
    free_bytes: int | None = None
    free_inodes: int | None = None
    total_inodes: int | None = None
    mount: str | None = None
    missing: bool | None = None      # the folder does not exist (preflight made nothing)
    exists_from: str | None = None   # then: the folder above it that does, where the write was tried


@dataclass(frozen=True)
class Scratch:
    tmp: Space | None = None
    cache: Space | None = None


@dataclass(frozen=True)
class Disk(Section, Space):
    workdir: str | None = None
    checked_path: str | None = None
    shm_bytes: int | None = None
    unsafe: Unsafe | None = None
    scratch: Scratch = Scratch()


@dataclass(frozen=True)
class Clock(Section):
    time: float | None = None
    timezone: str | None = None
    skew_s: float | None = None
    round_trip_s: float | None = None


@dataclass(frozen=True)
class Container:
    """The node's container runtime and image (nodectl/container.py: merge_report)."""
    runtime: str | None = None
    image: str | None = None
    installed: bool | None = None
    version: str | None = None
    usable: bool | None = None
    usable_output: str | None = None
    image_present: bool | None = None
    image_id: str | None = None
    pulled: bool | None = None
    pull_output: str | None = None
    probe_error: str | None = None


@dataclass(frozen=True)
class Environment:
    """The node's locked venv (runctl's env_status, nodectl/environment.py)."""
    key: str | None = None
    file: str | None = None
    present: bool | None = None
    intact: bool | None = None
    changed: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    drift: int | None = None
    packages: int | None = None
    installer: str | None = None


def _list_error(raw: Any) -> str | None:
    return str(raw.get("error")) if isinstance(raw, Mapping) and raw.get("error") else None


@dataclass(frozen=True)
class ProbeReport:
    """Every section, typed; `raw` the report as the node sent it. A section the probe could not read has its
    `error` (the list sections: `nics_error`, `infiniband_error`); `unreadable(section)` says why a check of it
    skips."""
    raw: Mapping = field(default_factory=dict, repr=False)
    os: Os = Os()
    cpu: Cpu = Cpu()
    memory: Memory = Memory()
    python: Python = Python()
    torch: Torch = Torch()
    gpus: Gpus = Gpus()
    nics: tuple[Nic, ...] = ()
    nics_error: str | None = None
    infiniband: tuple[IbDevice, ...] = ()
    infiniband_error: str | None = None
    modules: Modules = Modules()
    kernel_events: KernelEvents = KernelEvents()
    limits: Limits = Limits()
    cgroup: Cgroup = Cgroup()
    disk: Disk = Disk()
    clock: Clock = Clock()
    env: Mapping | None = None                        # the node's environment, secrets masked by the probe (None:
                                                      # not reported)
    packages: Mapping = field(default_factory=dict)   # distribution name: version
    container: Container | None = None
    environment: Environment | None = None

    @classmethod
    def of(cls, report: "ProbeReport | Mapping") -> "ProbeReport":
        """The typed report, parsed once: a ProbeReport is returned as it is."""
        if isinstance(report, ProbeReport):
            return report
        raw = report if isinstance(report, Mapping) else {}
        typed = parse(cls, {k: v for k, v in raw.items() if k not in ("raw", "nics_error", "infiniband_error")})
        env, packages = raw.get("env"), raw.get("packages")
        return replace(typed, raw=raw, nics_error=_list_error(raw.get("nics")),
                       infiniband_error=_list_error(raw.get("infiniband")),
                       env=env if isinstance(env, Mapping) and "error" not in env else None,
                       packages=packages if isinstance(packages, Mapping) and "error" not in packages else {})

    def unreadable(self, section: str) -> str | None:
        """Why a section of the report holds no facts (its probe failed or never ran), or None. A check whose
        facts could not be read says skip with this reason: never pass."""
        value = self.raw.get(section)
        if value is None:
            return f"the probe reported no {section} facts"
        if isinstance(value, Mapping) and value.get("error"):
            return f"{section} facts could not be read ({value['error']})"
        return None

    def has(self, section: str) -> bool:
        """The node sent this section (with facts, or with why it could not read them)."""
        return self.raw.get(section) is not None
