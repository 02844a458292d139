"""What a node answers, parsed once into types.

runctl (launchers/runctl/) answers each subcommand with one JSON object. `parse(command, raw)` turns it into
the dataclass below or raises `AnswerError` naming the field: a node that answers garbage (a broken or a
hostile one) costs the user one clear error, never a traceback deep in `status` or `top`. The contract test
(tests/contract/test_node_answers.py) runs the real runctl and probe and parses every answer.

A field with a default may be missing (an older runctl); one without must be there with its type. Unknown
keys are ignored.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Mapping, Union

from nodectl.resources.launchers.verbs import VERBS
from nodectl.transport import NodeError


class AnswerError(NodeError):
    """A node answered, but not with what the command answers."""


@dataclass(frozen=True)
class ExitRecord:
    code: int
    time: float = 0.0


@dataclass(frozen=True)
class RankState:
    rank: int
    exit: ExitRecord | None = None
    pid: int | None = None
    alive: bool = False
    ending: bool = False               # gone, its wrapper alive and still to write the exit record
    heartbeat: dict | None = None      # what the rank last wrote (step, time, phase...): its own fields
    heartbeat_age: float | None = None
    log_size: int = 0

    @property
    def step(self) -> Any:
        return (self.heartbeat or {}).get("step")


@dataclass(frozen=True)
class LogChunk:
    offset: int
    text: str
    start: int | None = field(default=None, metadata={"key": "from"})


NO_LOG = LogChunk(0, "")


@dataclass(frozen=True)
class GpuRow:
    """One GPU as nvidia-smi saw it during a poll (None where it said [N/A])."""

    index: int
    util: float | None = None
    mem_used_mib: float | None = None
    mem_total_mib: float | None = None
    temp_c: float | None = None
    power_w: float | None = None


@dataclass(frozen=True)
class GpuSample:
    gpus: tuple[GpuRow, ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class UploadState:
    """The node's uploader (launchers/nodectl_outputs.py): its rounds so far and its last error."""

    url: str
    rounds: int = 0
    files: int = 0
    bytes: int = 0
    last: float | None = None          # when the last round ended
    stored: int = 0                    # files the store holds for this node (its index)
    waiting: int = 0                   # files left for the next round (written just now, or changed while sent)
    final: bool = False                # the last round (after torchrun ended) is done
    error: str | None = None           # the last round's error; None once a round succeeded again
    error_time: float | None = None


@dataclass(frozen=True)
class RankPace:
    """One rank's collectives reached since the last poll (parallel lists: process group, sequence id, when it
    reached it in ns of the node's clock, how long it took in ms where NCCL timed it) and its scheduler counters."""

    groups: tuple[str, ...] = ()
    seqs: tuple[int, ...] = ()
    reached: tuple[int, ...] = ()
    durations: tuple[float | None, ...] = ()
    moved: tuple[int | None, ...] = ()  # bytes as nccl-tests counts them (an all-gather's output, else input)
    kinds: tuple[str | None, ...] = ()  # allreduce, gather, scatter, alltoall, other: the bus bandwidth's factor
    cpu_s: float | None = None          # CPU the rank's process used (its threads' schedstat), a counter
    runqueue_s: float | None = None     # time its threads were ready but waited for a CPU, a counter
    throttled_s: float | None = None    # time its cgroup's CPU quota held it back, a counter; None: no quota
    earlier: dict | None = None         # a one-shot poll's first look: the same counters `ago` seconds before


@dataclass(frozen=True)
class GpuDetail:
    """A GPU as the pace verdict looks at it: other processes on it, NVML's clock event reasons, its PCIe link."""

    others: tuple[dict, ...] = ()       # {pid, user, name} of each process on it that is not the run's
    reasons: int | None = None
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None


@dataclass(frozen=True)
class PaceSample:
    ranks: dict[str, RankPace] = field(default_factory=dict)
    cpu: dict = field(default_factory=dict)             # {cpus, load1, steal_s}
    gpus: dict[str, GpuDetail] = field(default_factory=dict)


@dataclass(frozen=True)
class PullAnswer:
    files: int
    bytes: int
    indexed: dict[str, int] = field(default_factory=dict)
    failed: tuple[dict, ...] = ()   # {path, error} of each file not brought (what was on the node stays)
    failed_count: int = 0


@dataclass(frozen=True, kw_only=True)
class HardwareEvent:
    """What a part of the node did since the run started (runctl/hardware.py): an Xid, a counter that rose, a
    GPU lost. `fatal`: the part cannot go on (a GPU of the run), the run fails on it."""

    part: str                     # "GPU 3", "GPU at PCI 0000:3b:00", "port mlx5_0/1"
    counter: str                  # "Xid 79 (GPU has fallen off the bus)", "uncorrectable ECC errors", "lost"
    rise: int = 1
    now: int | None = None        # the counter's value now
    fatal: bool = False
    time: float | None = None     # when last seen (the node's clock)
    first: float | None = None
    text: str | None = None       # the kernel's line, NVML's error


@dataclass(frozen=True)
class HardwareLook:
    events: tuple[HardwareEvent, ...] = ()
    notes: tuple[str, ...] = ()   # what could not be read (the kernel log), counters that were reset


@dataclass(frozen=True)
class PollAnswer:
    now: float
    node_rank: int
    alive: int
    ranks: tuple[RankState, ...]
    launcher_exit: ExitRecord | None = None
    started: bool = False
    stopped: bool = False
    logs: dict[str, LogChunk] = field(default_factory=dict)
    gpu_sample: GpuSample | None = None
    upload: UploadState | None = None
    same_boot: bool | None = None     # the node has not restarted since the run started (None: not known)
    checkpoint: int | None = None     # asked for: the step of the built-in trainer's newest complete checkpoint here
    pace: PaceSample | None = None
    seq: int | None = None            # a watch stream's line number (runctl watch), None for a poll
    asked: float | None = None        # the `sent` time of the latest request line the watcher had read
    hardware: HardwareLook | None = None   # asked for: the node's GPUs and ports since the run started


@dataclass(frozen=True)
class TailAnswer:
    logs: dict[str, LogChunk]


@dataclass(frozen=True)
class Unproven:
    """A process the node could not prove the run's, named and left alone (runctl.processes.unproven)."""
    pid: int
    name: str = ""
    started: float = 0.0


@dataclass(frozen=True)
class StopAnswer:
    left: int
    terminated: int = 0
    killed: int = 0
    time: float = 0.0
    removed: bool = False     # a run folder that was never started, removed (its controller died while starting)
    kept: bool = False        # a resumed run's folder, never started this attempt: kept whole (earlier attempts)
    container: dict | None = None   # the run's container on the node: {container, removed, error?}
    unproven: tuple[Unproven, ...] = ()


@dataclass(frozen=True)
class Stack:
    text: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class StacksAnswer:
    stacks: dict[str, Stack]
    tool: str = "?"


@dataclass(frozen=True)
class CpuUse:
    percent: float                     # of one core, over `seconds`
    threads: dict[str, float] = field(default_factory=dict)   # the busiest threads by id
    seconds: float = 0.0


@dataclass(frozen=True)
class RankDump(RankState):
    """One rank as `diagnose` saw it. `listener` is what the rank's own listener (launchers/sitecustomize.py)
    answered from inside the process: stacks and flight recorder, kept as a mapping and read by
    nodectl/diagnose/flight.py, which checks each part's shape itself."""

    log_tail: str = ""
    cpu: CpuUse | None = None
    main_state: str | None = None      # R running, S sleeping, D in I/O (the main thread's)
    listener: dict | None = None
    listener_error: str | None = None
    stack: Stack | None = None         # py-spy or faulthandler, for a rank without a listener


@dataclass(frozen=True)
class DiagnoseAnswer:
    now: float
    node_rank: int
    ranks: dict[str, RankDump]
    launcher_exit: ExitRecord | None = None
    gpu_sample: GpuSample | None = None
    timeout_dumps: tuple[str, ...] = ()


@dataclass(frozen=True)
class PackAnswer:
    archive: str
    entries: int
    bytes: int
    vanished: int = 0
    skipped: tuple[str, ...] = ()    # fifos, sockets, devices, links out of the run: left out by the node
    missing: tuple[str, ...] = ()    # asked-for paths (collect --path) that are not there, or not inside the run
    code_written: int = 0            # files the program wrote under code/ (its relative outputs), brought back
    code_examples: tuple[str, ...] = ()
    code_left: int = 0               # the synced project's files, left on the node (the user has them)


@dataclass(frozen=True)
class FillAnswer:
    """What a node took of another node's output/ (runctl fill): files it lacked, and what it kept of its own."""
    added: int
    bytes: int
    kept: int = 0
    refused: tuple[str, ...] = ()


@dataclass(frozen=True)
class PortAnswer:
    port: int
    free: bool
    asked: int = 0


@dataclass(frozen=True)
class PrepareAnswer:
    run_dir: str
    files: int = 0


@dataclass(frozen=True)
class StartAnswer:
    pgid: int


@dataclass(frozen=True)
class HaveAnswer:
    missing: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class CpuShare:
    """The CPUs a node's login may use and its kernel's boot id: nodes of one boot share the CPUs they have in
    common (plan.threads_per_rank)."""
    available: int
    cpu_set: tuple[int, ...]
    boot_id: str | None = None


@dataclass(frozen=True)
class IdentityAnswer:
    identity: str
    workdir: str
    missing: tuple[str, ...] | None = None
    cpu: CpuShare | None = None


@dataclass(frozen=True)
class ReceiveAnswer:
    """Objects received; with a `prepare` request in the same call, the prepared run folder too."""

    received: int = 0
    bytes: int = 0
    run_dir: str | None = None
    files: int = 0


@dataclass(frozen=True)
class ListenAnswer:
    pid: int
    port: int
    ephemeral: int | None = None                      # with ephemeral=: a port the kernel picked, as gloo's
    ephemeral_range: tuple[int, ...] | None = None    # net.ipv4.ip_local_port_range: where such ports come from


@dataclass(frozen=True)
class ConnectAnswer:
    ok: bool
    ms: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class RouteAnswer:
    dev: str | None = None
    raw: str | None = None
    peers: dict[str, str | None] = field(default_factory=dict)   # another node's address -> the interface toward it
    reach: ConnectAnswer | None = None   # with connect=: the TCP connection to the master's port, made first
    peer_reach: dict[str, ConnectAnswer] = field(default_factory=dict)   # another node's address -> the connection
                                                                         # to its ephemeral listener
    resolved: tuple[str, ...] | dict | None = None   # with resolve=: the addresses of that name here, or {"error"}
    resolved_line: dict | None = None                # the /etc/hosts line naming it
    own: tuple[str, ...] = ()                        # with resolve=: the node's own interface addresses


@dataclass(frozen=True)
class ContainerAnswer:
    """The node's container runtime and image as `container` found them (nodectl/container.py)."""

    installed: bool | None
    version: str = ""
    usable: bool = False
    usable_output: str = ""
    image_present: bool | None = None
    image_id: str | None = None
    pulled: bool = False
    pull_output: str = ""
    probe: dict | None = None      # launchers/probe.py's report from inside the image, or {"error": ...}


@dataclass(frozen=True)
class EnvAnswer:
    """A node's locked environment (`env_status`, `env_build`): its interpreter and platform, the venv's key and
    whether it is there and unchanged since it was built (nodectl/environment.py)."""

    key: str
    python_path: str
    present: bool = False
    intact: bool | None = None
    python: str = "?"
    implementation: str = "?"
    machine: str = "?"
    libc: str = ""
    libc_version: str = ""
    executable: str = ""
    built: float | None = None
    packages: int | None = None
    installer: str | None = None
    seconds: float | None = None
    changed: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    drift: int = 0
    reused: bool | None = None
    replaced: str | None = None


@dataclass(frozen=True)
class Done:
    """An answer that carries nothing but its arrival (serve, unlisten, cleanup)."""


# Each verb's answer type, as runctl's table of verbs (launchers/runctl/verbs.py) names it.
ANSWERS: dict[str, type] = {name: globals()[verb.answer] for name, verb in VERBS.items()}


def parse(command: str, raw: Mapping) -> Any:
    """runctl's answer to `command` as its dataclass; AnswerError (naming the field) when it is not one."""
    return build(ANSWERS[command], raw, f"runctl {command}")


def build(cls: type, raw: Any, where: str) -> Any:
    if not isinstance(raw, Mapping):
        raise AnswerError(f"{where}: expected an object, got {_kind(raw)}")
    values = {}
    for name, key, required, read in _fields(cls):
        if key not in raw:
            if required:
                raise AnswerError(f"{where}: `{key}` is missing")
            continue
        values[name] = read(raw[key], f"{where}: `{key}`")
    return cls(**values)


@lru_cache(maxsize=None)
def _fields(cls: type) -> tuple:
    """(name, key, required, reader) of each field of `cls`, worked out once per class: a watch reads a line a
    second from every node, and reflecting on the types for each one cost the controller ~2 ms a line."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, f.metadata.get("key", f.name),
                  f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING, _reader(hints[f.name]))
                 for f in dataclasses.fields(cls))


def _checked(accepts, wanted: str, make=None):
    def read(value, where):
        if not accepts(value):
            raise AnswerError(f"{where}: expected {wanted}, got {_kind(value)}")
        return make(value) if make else value
    return read


@lru_cache(maxsize=None)
def _reader(kind: Any):
    """A function (value, where) -> the value read as `kind`, or AnswerError naming `where`. Elements of a list or
    an object are read with their container's `where` and, only when one fails, read again with their own."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (Union, types.UnionType):
        nullable, options = type(None) in args, tuple(_reader(a) for a in args if a is not type(None))

        def read_union(value, where):
            if value is None and nullable:
                return None
            last = None
            for option in options:
                try:
                    return option(value, where)
                except AnswerError as exc:
                    last = exc
            raise last or AnswerError(f"{where}: unexpected {_kind(value)}")
        return read_union
    if dataclasses.is_dataclass(kind):
        return lambda value, where: build(kind, value, where)
    if origin is tuple:
        item = _reader(args[0])

        def read_list(value, where):
            if not isinstance(value, list):
                raise AnswerError(f"{where}: expected a list, got {_kind(value)}")
            try:
                return tuple(item(v, where) for v in value)
            except AnswerError:
                return tuple(item(v, f"{where}[{i}]") for i, v in enumerate(value))
        return read_list
    if origin is dict:
        item = _reader(args[1])

        def read_map(value, where):
            if not isinstance(value, Mapping):
                raise AnswerError(f"{where}: expected an object, got {_kind(value)}")
            try:
                return {str(k): item(v, where) for k, v in value.items()}
            except AnswerError:
                return {str(k): item(v, f"{where}[{k}]") for k, v in value.items()}
        return read_map
    if kind is bool:
        return _checked(lambda v: isinstance(v, bool), "true or false")
    if kind is int:
        return _checked(lambda v: type(v) is int or isinstance(v, int) and not isinstance(v, bool), "a whole number")
    if kind is float:
        return _checked(lambda v: type(v) is float or isinstance(v, (int, float)) and not isinstance(v, bool),
                        "a number", float)
    if kind is str:
        return _checked(lambda v: isinstance(v, str), "text")
    if kind is dict:
        return _checked(lambda v: isinstance(v, Mapping), "an object", dict)
    raise TypeError(f"no reading for {kind!r}")  # a programming error in this module, not a node's


def _kind(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


# The probe's report (launchers/probe.py) and the GPU job's answer (launchers/gpuhealth.py) stay JSON mappings: they
# are stored as they came (preflight.json, env-dump) and judged by pure functions that read them by section. They
# are parsed here once for their shape: each section an object (or, where it lists records, a list of objects;
# a section whose facts could not be read is {"error": ...}), so a broken or hostile node is one node's error, not
# a traceback in a check. The contract test keeps the key names of both sides in step.
PROBE_OBJECTS = ("os", "cpu", "memory", "python", "torch", "packages", "gpus", "modules", "kernel_events", "limits",
                 "cgroup", "disk", "env", "clock")
PROBE_LISTS = ("nics", "infiniband")


def parse_probe(raw: Any) -> dict:
    if not isinstance(raw, Mapping):
        raise AnswerError(f"the probe's report: expected an object, got {_kind(raw)}")
    for section in PROBE_OBJECTS + PROBE_LISTS:
        value = raw.get(section)
        if value is None or (isinstance(value, Mapping) and (section in PROBE_OBJECTS or "error" in value)):
            continue
        if section in PROBE_LISTS and isinstance(value, list) and all(isinstance(v, Mapping) for v in value):
            continue
        raise AnswerError(f"the probe's report: `{section}`: expected "
                          f"{'a list of objects' if section in PROBE_LISTS else 'an object'}, got {_kind(value)}")
    devices = (raw.get("gpus") or {}).get("devices")
    if devices is not None and not (isinstance(devices, list) and all(isinstance(d, Mapping) for d in devices)):
        raise AnswerError(f"the probe's report: `gpus.devices`: expected a list of objects, got {_kind(devices)}")
    return dict(raw)


def parse_gpu_job(raw: Any) -> dict:
    if not isinstance(raw, Mapping):
        raise AnswerError(f"the GPU job's answer: expected an object, got {_kind(raw)}")
    for key in ("devices", "pairs"):
        value = raw.get(key)
        if value is not None and not (isinstance(value, list) and all(isinstance(v, Mapping) for v in value)):
            raise AnswerError(f"the GPU job's answer: `{key}`: expected a list of objects, got {_kind(value)}")
    return dict(raw)
