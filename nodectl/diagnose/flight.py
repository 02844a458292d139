"""Reading what a rank's listener answered: its threads' stacks and torch's flight recorder, in every dump format
met so far, into the records the verdicts work on.

The flight recorder's dump is a mapping with `version`, `pg_config`, `pg_status` and `entries` (one per
collective or point-to-point op). The formats met and saved (tests/data/diagnose/), by `version` (the dump's
field, not torch's version):
- "2.10" from torch 2.11 (NCCL 2.28.9 on an H200, and gloo) and torch 2.13 (gloo): `collective_seq_id`,
  `p2p_seq_id`, `pg_id`, `process_group` as [name, description], `profiling_name` "nccl:all_reduce",
  `input_sizes`/`input_dtypes`, `state`, `retired`, `time_created_ns`; `pg_status` keyed by the group's id with
  `last_enqueued_collective`/`last_completed_collective`. NCCL moves `state` from scheduled to started to
  completed. gloo never moves it past "scheduled": a gloo op is done when `retired` is true, or when its sequence
  id is at or below the group's `last_completed_collective`. gloo's `pg_config` names the default group ""
  where NCCL's names it "0" (torch's own analyser, `torchfrtrace`, fails on gloo dumps for that reason).
- torch before 2.4 named the sequence id `seq_id`; a dump without `pg_status` is judged from its entries alone.
  torch 2.6-2.10 were not met here; their dumps carry the same keys as far as torch's analyser reads them.
Anything else in a dump is ignored, and a malformed part is skipped with a note: the answer comes from a node.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

UNEVEN_OPS = ("gather", "scatter", "send", "recv", "recv_anysource")   # and every all-to-all
LIBRARY_PARTS = ("/site-packages/", "/dist-packages/", "/lib/python3", "<frozen ", "/launchers/", "/lib/sitecustomize")


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str
    text: str = ""

    @property
    def library(self) -> bool:
        """Python's own modules, installed packages (torch among them), nodectl's helpers: not the user's code."""
        return any(part in self.file for part in LIBRARY_PARTS) or self.file.startswith("<")

    def where(self, shorten=lambda path: path) -> str:
        return f"{shorten(self.file)}:{self.line} in `{self.function}`"


@dataclass(frozen=True)
class ThreadStack:
    name: str
    main: bool
    frames: tuple[Frame, ...]          # outermost first
    native_id: int | None = None

    def innermost_user_frame(self) -> Frame | None:
        """Where the program itself is: the innermost frame of its own code, else the innermost frame."""
        for frame in reversed(self.frames):
            if not frame.library:
                return frame
        return self.frames[-1] if self.frames else None

    def calls(self, *names: str) -> bool:
        return any(frame.function in names for frame in self.frames)


@dataclass(frozen=True)
class Collective:
    backend: str
    group: str            # the process group's id in the recorder ("0" for the default group)
    group_desc: str
    seq: int              # collective_seq_id (p2p_seq_id for a send/recv)
    op: str               # all_reduce, all_gather, _allgather_base, send...
    input_sizes: tuple
    input_dtypes: tuple
    output_sizes: tuple
    output_dtypes: tuple
    state: str            # scheduled | started | completed (what the recorder says)
    done: bool            # completed, whatever the backend calls it
    created: float | None  # seconds since the epoch
    p2p: bool = False
    frames: tuple[Frame, ...] = ()    # where the program called it, innermost first (as the recorder lists them)

    def signature(self) -> tuple:
        """What every rank must agree on: the op, and for ops whose inputs are the same shape on every rank, the
        input sizes and dtypes (all-to-all and the gather/scatter family take uneven or root-only inputs)."""
        if self.op in UNEVEN_OPS or self.op.startswith(("alltoall", "all_to_all")):
            return (self.op,)
        return (self.op, self.input_sizes, self.input_dtypes)

    def label(self) -> str:
        return f"{self.op} #{self.seq} (group {self.group})"

    def shapes(self) -> str:
        """'input [4] Float', 'inputs [4], [2, 3] Float'."""
        sizes = [_shape(size) for size in self.input_sizes]
        dtypes = sorted({str(d) for d in self.input_dtypes})
        return f"input{'s' if len(sizes) > 1 else ''} {', '.join(sizes) or '[]'} {', '.join(dtypes)}".rstrip()

    def called_at(self) -> Frame | None:
        return next((f for f in self.frames if not f.library), self.frames[0] if self.frames else None)


@dataclass(frozen=True)
class Recorder:
    """One rank's flight recorder(s), read."""

    collectives: tuple[Collective, ...] = ()
    last_enqueued: dict[str, int] = field(default_factory=dict)    # group -> highest collective seq entered
    last_completed: dict[str, int] = field(default_factory=dict)
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)   # group -> its global ranks, where known
    versions: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    present: bool = False  # the rank has a recorder with something in it

    def pending(self) -> list[Collective]:
        return [c for c in self.collectives if not c.done]


def read_threads(listener: Mapping | None) -> tuple[ThreadStack, ...]:
    threads = []
    for raw in _list(listener, "threads"):
        if not isinstance(raw, Mapping):
            continue
        frames = tuple(f for f in (_frame_of_list(item) for item in _list(raw, "frames")) if f)
        native = raw.get("native_id")
        threads.append(ThreadStack(str(raw.get("name", "?")), raw.get("main") is True, frames,
                                   native if isinstance(native, int) and not isinstance(native, bool) else None))
    return tuple(threads)


def read_recorder(listener: Mapping | None) -> Recorder:
    """Every flight recorder the listener sent (NCCL and gloo), merged."""
    flight = listener.get("flight") if isinstance(listener, Mapping) else None
    if not isinstance(flight, Mapping):
        return Recorder()
    collectives, enqueued, completed, groups, versions, notes = [], {}, {}, {}, [], []
    for backend, dump in flight.items():
        if not isinstance(dump, Mapping):
            continue
        if "error" in dump:
            notes.append(f"{backend} flight recorder: {dump['error']}")
            continue
        versions.append(f"{backend} {dump.get('version', '?')}")
        status = _status(dump.get("pg_status"))
        for group, values in status.items():
            if "last_enqueued_collective" in values:
                enqueued[group] = max(enqueued.get(group, -1), values["last_enqueued_collective"])
            if "last_completed_collective" in values:
                completed[group] = max(completed.get(group, -1), values["last_completed_collective"])
        groups.update(_groups(dump.get("pg_config")))
        for raw in _list(dump, "entries"):
            entry = _collective(str(backend), raw, status)
            if entry is None:
                notes.append(f"{backend}: an entry of unknown shape was skipped")
                continue
            collectives.append(entry)
            if not entry.p2p:
                enqueued[entry.group] = max(enqueued.get(entry.group, -1), entry.seq)
                if entry.done:
                    completed[entry.group] = max(completed.get(entry.group, -1), entry.seq)
    return Recorder(tuple(collectives), enqueued, completed, groups, tuple(versions), tuple(notes),
                    present=bool(collectives or enqueued))


def _collective(backend: str, raw: Any, status: dict) -> Collective | None:
    if not isinstance(raw, Mapping):
        return None
    p2p = raw.get("is_p2p") is True
    seq = raw.get("p2p_seq_id") if p2p else raw.get("collective_seq_id", raw.get("seq_id"))
    name = raw.get("profiling_name")
    if not _whole(seq) or not isinstance(name, str):
        return None
    group_raw = raw.get("pg_id")
    described = raw.get("process_group")
    if not _whole(group_raw) and isinstance(described, (list, tuple)) and described:
        group_raw = described[0]
    group = str(group_raw) if group_raw is not None else "0"
    desc = str(described[1]) if isinstance(described, (list, tuple)) and len(described) > 1 else ""
    state = str(raw.get("state", "?"))
    last_completed = status.get(group, {}).get("last_completed_collective", -1)
    done = state == "completed" or raw.get("retired") is True or (not p2p and seq <= last_completed)
    created = raw.get("time_created_ns")
    frames = tuple(f for f in (_frame_of_mapping(item) for item in _list(raw, "frames")) if f)
    return Collective(backend, group, desc, seq, name.split(":", 1)[-1], _tuple(raw.get("input_sizes")),
                      _tuple(raw.get("input_dtypes")), _tuple(raw.get("output_sizes")),
                      _tuple(raw.get("output_dtypes")), state, done,
                      created / 1e9 if _whole(created) else None, p2p, frames)


def _status(raw: Any) -> dict[str, dict[str, int]]:
    out = {}
    if isinstance(raw, Mapping):
        for group, values in raw.items():
            if isinstance(values, Mapping):
                out[str(group)] = {k: v for k, v in values.items() if _whole(v)}
    return out


def _groups(raw: Any) -> dict[str, tuple[int, ...]]:
    """pg_config: {group: {"ranks": "[0, 1]", ...}} (the ranks as text in every version met)."""
    out = {}
    if not isinstance(raw, Mapping):
        return out
    for group, values in raw.items():
        ranks = values.get("ranks") if isinstance(values, Mapping) else None
        if isinstance(ranks, str):
            try:
                ranks = json.loads(ranks)
            except (ValueError, RecursionError):
                continue
        if isinstance(ranks, list) and ranks and all(_whole(r) for r in ranks):
            out[str(group)] = tuple(ranks)
    return out


def _frame_of_list(raw: Any) -> Frame | None:
    """[file, line, function, text] (the listener's own form)."""
    if isinstance(raw, (list, tuple)) and len(raw) >= 3 and isinstance(raw[0], str) and _whole(raw[1]):
        text = raw[3] if len(raw) > 3 and isinstance(raw[3], str) else ""
        return Frame(raw[0], raw[1], str(raw[2]), text)
    return None


def _frame_of_mapping(raw: Any) -> Frame | None:
    """{"filename", "line", "name"} (the flight recorder's form)."""
    if isinstance(raw, Mapping) and isinstance(raw.get("filename"), str) and _whole(raw.get("line")):
        return Frame(raw["filename"], raw["line"], str(raw.get("name", "?")))
    return None


def _list(raw: Any, key: str) -> list:
    value = raw.get(key) if isinstance(raw, Mapping) else None
    return value if isinstance(value, list) else []


def _shape(size: Any) -> str:
    return "[" + ", ".join(str(d) for d in size) + "]" if isinstance(size, tuple) else str(size)


def _tuple(value: Any) -> tuple:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(_tuple(v) for v in value)
    return value if isinstance(value, (int, float, str)) else str(value)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
