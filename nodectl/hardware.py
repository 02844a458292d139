"""The run's hardware as its nodes see it while it runs (runctl/hardware.py): each event in words, the one that
fails the run, and those told once each to the attached launch and kept in preflight's history."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from nodectl.remote.answers import HardwareEvent
from nodectl.transport import NodeResult


def events_of(states: Mapping[str, NodeResult]) -> list[tuple[str, HardwareEvent]]:
    """(node, event) of every node's latest answer, fatal ones first, then oldest first."""
    found = []
    for name, result in states.items():
        look = result.value.hardware if result.ok and result.value else None
        for event in (look.events if look else ()):
            found.append((name, event))
    return sorted(found, key=lambda item: (not item[1].fatal, item[1].time or 0.0))


def notes_of(states: Mapping[str, NodeResult]) -> list[tuple[str, str]]:
    return [(name, note) for name, result in states.items()
            for note in ((result.value.hardware.notes if result.ok and result.value and result.value.hardware
                          else ()))]


def describe(node: str, event: HardwareEvent, now: float | None = None) -> str:
    """"GPU 1 of node1: 2 Xid 79 (GPU has fallen off the bus) since the run started, last 40s ago: the part
    cannot go on"."""
    where = f"{event.part} of {node}"
    if event.counter == "lost":
        said = f"{where} lost ({event.text or 'NVML no longer reaches it'})"
    elif event.counter.startswith("Xid"):
        said = f"{where}: {event.rise} {event.counter} since the run started"
    else:
        said = f"{where}: {event.counter} rose by {event.rise}" + (f" to {event.now}" if event.now is not None else "") \
            + " since the run started"
    if event.time:
        ago = max(0.0, (now or time.time()) - event.time)
        said += f", last {ago:.0f}s ago" if ago < 3600 else f", last at {time.strftime('%H:%M:%S', time.localtime(event.time))}"
    if event.fatal:
        said += ": the part cannot go on (leave the node out with --exclude-failed; reset or replace the GPU)"
    return said


def lines(states: Mapping[str, NodeResult], now: float | None = None) -> list[str]:
    """`status` and `top`: one line per event, then what could not be read, once per node and note."""
    said = [f"hardware: {describe(name, event, now)}" for name, event in events_of(states)]
    said += [f"hardware: {name}: {note}" for name, note in notes_of(states)]
    return said


def to_json(states: Mapping[str, NodeResult]) -> list[dict]:
    return [{"node": name, "part": e.part, "counter": e.counter, "rise": e.rise, "now": e.now, "fatal": e.fatal,
             "time": e.time, "text": e.text} for name, e in events_of(states)]


def fatal(states: Mapping[str, NodeResult]) -> tuple[str, HardwareEvent] | None:
    """The first event that makes a part of the run unusable, if any."""
    return next(((name, event) for name, event in events_of(states) if event.fatal), None)


@dataclass
class HardwareNotices:
    """Tells each event once, and again when it rises further (each told event also reaches `remember`, for
    preflight's history); each note once per node."""

    tell: Callable[[str, HardwareEvent], None]
    note: Callable[[str, str], None]
    remember: Callable[[str, HardwareEvent], None] = lambda node, event: None
    told: dict = field(default_factory=dict)          # (node, part, counter) -> the rise last told
    noted: set = field(default_factory=set)

    def __call__(self, states: Mapping[str, NodeResult]) -> None:
        for name, event in events_of(states):
            key = (name, event.part, event.counter)
            if self.told.get(key) == event.rise:
                continue
            self.told[key] = event.rise
            self.tell(name, event)
            try:
                self.remember(name, event)
            except OSError:
                pass   # the history is a help; a full disk here must not end the watch
        for name, note in notes_of(states):
            if (name, note) not in self.noted:
                self.noted.add((name, note))
                self.note(name, note)
