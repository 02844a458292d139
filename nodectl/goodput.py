"""Goodput: a run's wall time split into productive training and each kind of lost time (Google's
ml-goodput-measurement's badput kinds, from what nodectl sees of any script).

The facts come from the run folder: `timeline.jsonl` (what the launch did and saw, a line per fact: the launch, each
attempt's start, its first step, a failure and when it was noticed, the stop, where the next attempt continues
from), the manifest (its attempts), `pace.jsonl` (the pace's judged windows) and the ranks' heartbeats as the watch
last read them (rank 0's cumulative `checkpoint_s`, `eval_s`, `data_s`: the built-in trainer's, or a script's
through nodectl_metrics.phase). The kinds add up to the wall clock; what could not be seen is named in `unseen`.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from nodectl.report import jsonl_objects

TIMELINE = "timeline.jsonl"
KINDS = ("set-up", "start-up", "checkpoints", "evaluation", "data waits", "failures", "restarts", "work redone",
         "slow-downs")
# what each kind holds, for --json readers and the docs
MEANING = {
    "set-up": "from the launch to the first attempt's start: preflight, environments, code sent",
    "start-up": "from each attempt's start to its first step: processes, imports, model load, compile",
    "checkpoints": "the trainer (or script) waiting while a checkpoint is saved",
    "evaluation": "evaluation passes",
    "data waits": "ranks waiting for their batches",
    "failures": "from a failure to nodectl noticing it",
    "restarts": "from noticing a failure to the next attempt's start: the stop, the check, the start",
    "work redone": "the steps between the checkpoint an attempt continued from and the step the last one reached",
    "slow-downs": "time lost to a pace under the run's own healthy pace",
}


@dataclass(frozen=True, kw_only=True)
class Goodput:
    wall: float                      # seconds from the launch to the end (or now)
    productive: float
    lost: dict                       # kind -> seconds, every kind of KINDS
    unseen: tuple[str, ...] = ()     # kinds nodectl could not see for this run, with why
    attempts: tuple[dict, ...] = ()  # each attempt: number, start, end, first step, how it ended, resumed from

    @property
    def share(self) -> float | None:
        return self.productive / self.wall if self.wall > 0 else None

    def to_json(self) -> dict:
        return {"wall_s": round(self.wall, 2), "productive_s": round(self.productive, 2),
                "goodput": round(self.share, 4) if self.share is not None else None,
                "lost_s": {k: round(v, 2) for k, v in self.lost.items()}, "unseen": list(self.unseen),
                "attempts": list(self.attempts)}

    def line(self, live: bool) -> str:
        """`goodput 91% so far; lost 2m10s: start-up 1m31s, checkpoints 37s, ...`"""
        if self.share is None:
            return ""
        lost = sorted(((k, v) for k, v in self.lost.items() if v >= 0.5), key=lambda kv: -kv[1])
        said = f"goodput {self.share * 100:.0f}%{' so far' if live else ''}"
        if lost:
            said += f"; lost {span(sum(v for _, v in lost))}: " + ", ".join(f"{k} {span(v)}" for k, v in lost)
        if self.unseen:
            said += f" (not seen: {'; '.join(self.unseen)})"
        return said


def span(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Timeline:
    """runs/<id>/timeline.jsonl: appended by the launch, read whole by the ledger. A damaged line costs that
    line, never the ledger."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / TIMELINE

    def add(self, what: str, attempt: int, when: float | None = None, **facts) -> None:
        entry = {"time": round(when if when is not None else time.time(), 3), "what": what, "attempt": attempt,
                 **facts}
        try:
            with open(self.path, "a", encoding="utf-8") as out:
                out.write(json.dumps(entry) + "\n")
        except OSError:
            pass   # the ledger is a help: a full disk must not end the launch

    def entries(self) -> list[dict]:
        return [entry for entry in jsonl_objects(self.path)
                if _real(entry.get("time")) and isinstance(entry.get("what"), str)
                and isinstance(entry.get("attempt"), int) and not isinstance(entry.get("attempt"), bool)]


def _real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _phase(value) -> float:
    """A cumulative phase figure from a heartbeat: a finite number of seconds >= 0, else 0 (a negative or
    non-number mark counts as nothing)."""
    return float(value) if _real(value) and value >= 0 else 0.0


def ledger(entries: list[dict], *, now: float, ended: float | None = None, pace_windows: list[dict] = (),
           beats: dict | None = None) -> Goodput | None:
    """The run's goodput from its timeline (`entries`), up to `ended` or `now`. `beats`: attempt -> rank 0's last
    heartbeat seen in it (its cumulative phases and its step, time). None without a launch on the timeline (a run
    recorded before the ledger existed)."""
    launched = next((e["time"] for e in entries if e["what"] == "launch"), None)
    if launched is None:
        return None
    end = ended if ended is not None and ended >= launched else now
    wall = max(0.0, end - launched)
    lost = dict.fromkeys(KINDS, 0.0)
    unseen: list[str] = []
    by_attempt: dict[int, dict] = {}
    for e in entries:
        facts = by_attempt.setdefault(e["attempt"], {})
        facts.setdefault(e["what"], e)   # the first of each kind per attempt
    starts = sorted((a, f["started"]["time"]) for a, f in by_attempt.items() if "started" in f)
    if not starts:
        lost["set-up"] = wall
        return Goodput(wall=wall, productive=0.0, lost=lost, unseen=("nothing started yet",))
    lost["set-up"] = max(0.0, min(starts[0][1], end) - launched)
    attempts = []
    beats = {**beats_of(entries), **(beats or {})}
    for index, (attempt, began) in enumerate(starts):
        facts = by_attempt[attempt]
        closes = starts[index + 1][1] if index + 1 < len(starts) else end
        first = facts.get("first step", {}).get("time")
        failed = facts.get("failed", {}).get("time")
        noticed = facts.get("noticed", {}).get("time")
        stops = min(x for x in (noticed, closes) if x is not None)
        if first is None:
            lost["start-up" if index == 0 else "restarts"] += max(0.0, min(stops, end) - began)
            working = 0.0
            if stops > began:
                unseen.append(f"attempt {attempt}'s first step")
        else:
            lost["start-up" if index == 0 else "restarts"] += max(0.0, min(first, stops) - began)
            working = max(0.0, min(failed if failed is not None else stops, stops) - first)
        if failed is not None and noticed is not None:
            lost["failures"] += max(0.0, min(noticed, closes) - min(failed, noticed))
        if noticed is not None and index + 1 < len(starts):
            lost["restarts"] += max(0.0, closes - noticed)
        beat = beats.get(attempt) or {}
        phases = {kind: min(_phase(beat.get(key)), working) for kind, key in
                  (("checkpoints", "checkpoint_s"), ("evaluation", "eval_s"), ("data waits", "data_s"))}
        used = 0.0
        for kind, seconds in phases.items():
            seconds = min(seconds, max(0.0, working - used))
            lost[kind] += seconds
            used += seconds
        redo = facts.get("continuing") if index > 0 else None
        step_s = _step_time([e for e in entries if e["what"] == "beat" and e["attempt"] == starts[index - 1][0]]) \
            if index > 0 else None
        redone, resumed = 0.0, None
        # where a later attempt went on from: its first step says it (a script keeps its own checkpoints, which
        # nodectl cannot see; a --resume too), else the checkpoint nodectl saw, else the start
        seen = facts.get("first step", {}).get("step") if index > 0 else None
        if _real(seen):
            resumed = seen - 1
        elif redo:
            resumed = redo.get("checkpoint") if _real(redo.get("checkpoint")) else 0
        if redo and step_s and _real(redo.get("reached")) and resumed is not None:
            redone = max(0.0, (redo["reached"] - resumed) * step_s)
            lost["work redone"] += redone
        attempts.append({"attempt": attempt, "started": began, "first_step": first, "ended": closes,
                         "failed": failed, "noticed": noticed,
                         "continued_from": resumed, "redone_s": round(redone, 2)})
    unseen += _unmarked([beats.get(a) or {} for a, _ in starts])
    lost["slow-downs"] = _slow(pace_windows, launched, end)
    total = sum(lost.values())
    if total > wall:   # overlapping views of one second (a slow window inside a checkpoint): scaled to the clock
        scale = wall / total
        lost = {k: v * scale for k, v in lost.items()}
        total = wall
    return Goodput(wall=wall, productive=max(0.0, wall - total), lost=lost, unseen=tuple(unseen),
                   attempts=tuple(attempts))


PHASE_KEYS = (("checkpoints", "checkpoint_s"), ("evaluation", "eval_s"), ("data waits", "data_s"))


def _unmarked(beats: list[dict]) -> list[str]:
    """The phase kinds no heartbeat of the run carries, and why: the script marks none, or the trainer nodectl
    wrapped (its `phases_by`) does not say when they happen."""
    missing = [kind for kind, key in PHASE_KEYS if not any(key in beat for beat in beats)]
    if not missing:
        return []
    if len(missing) == len(PHASE_KEYS):
        return ["checkpoints, evaluation and data waits (the script marks none: nodectl_metrics.phase)"]
    by = next((beat["phases_by"] for beat in beats if isinstance(beat.get("phases_by"), str)), None)
    return [" and ".join(missing) + (f" ({by} does not say when they happen; nodectl_metrics.phase marks them)"
                                     if by else " (the script marks none: nodectl_metrics.phase)")]


def _step_time(beats: list[dict]) -> float | None:
    """Seconds of training per step of an attempt, between its first and last `beat` lines, less what its phases
    took meanwhile (checkpoints, evaluation, data waits: kinds of their own, never counted twice)."""
    beats = [b for b in beats if _real(b.get("step"))]
    if len(beats) < 2:
        return None
    first, last = beats[0], beats[-1]
    aside = sum(_phase(last.get(k)) - _phase(first.get(k)) for k in ("checkpoint_s", "eval_s", "data_s"))
    steps, seconds = last["step"] - first["step"], last["time"] - first["time"] - max(0.0, aside)
    return seconds / steps if steps > 0 and seconds > 0 else None


def _slow(windows, since: float, until: float) -> float:
    """Seconds lost to a pace under 1: each judged window's (1 - pace) times the time since the one before."""
    lost, last = 0.0, None
    for window in windows:
        at, pace = window.get("time"), window.get("pace")
        if not _real(at) or at < since or at > until:
            continue
        if last is not None and _real(pace) and 0 < pace < 1:
            lost += (1 - pace) * (at - last)
        last = at
    return lost


BEAT_EVERY = 30.0   # seconds between two `beat` lines of the timeline while rank 0's phases stay as they were


class Beats:
    """What the attached watch sees of rank 0's heartbeat, kept on the timeline: the attempt's first step (its
    heartbeat's own time) and, every BEAT_EVERY seconds or when a phase total changes, its step and phase totals
    (the ledger takes the last one of each attempt)."""

    def __init__(self, timeline: Timeline, attempt: int) -> None:
        self.timeline, self.attempt = timeline, attempt
        self.first: float | None = None
        self.kept: dict | None = None
        self.last: dict | None = None

    def __call__(self, fresh) -> None:
        for result in fresh.values():
            answer = result.value if result.ok else None
            for rank in (answer.ranks if answer else ()):
                if rank.rank == 0 and isinstance(rank.heartbeat, dict):
                    self._see(rank.heartbeat)

    def _see(self, beat: dict) -> None:
        step, at = beat.get("step"), beat.get("time")
        if not _real(step) or not _real(at) or step < 1:
            return
        if self.first is None:
            first = beat.get("first_step_at") if _real(beat.get("first_step_at")) else at
            self.first = first
            own = beat.get("first_step") if _real(beat.get("first_step")) else step   # where the attempt began
            self.timeline.add("first step", self.attempt, when=min(first, time.time()), step=own)
        phases = {k: beat[k] for k in ("checkpoint_s", "eval_s", "data_s") if _real(beat.get(k))}
        by = beat.get("phases_by")
        self.last = {"step": step, "beat_time": at, **phases,
                     **({"phases_by": by[:80]} if isinstance(by, str) else {})}
        if self.kept is None or phases != {k: self.kept.get(k) for k in phases if k in self.kept} \
                or at - self.kept["beat_time"] >= BEAT_EVERY:
            self.flush()

    def flush(self) -> None:
        if self.last is not None and self.last != self.kept:
            self.kept = self.last
            self.timeline.add("beat", self.attempt, when=self.last["beat_time"],
                              **{k: v for k, v in self.last.items() if k != "beat_time"})


def beats_of(entries: list[dict]) -> dict:
    """attempt -> its last `beat` line (step, time, phase totals), for ledger()."""
    out: dict = {}
    for entry in entries:
        if entry["what"] == "beat":
            out[entry["attempt"]] = {**entry, "time": entry["time"]}
    return out


def of_run(run, live_beat: dict | None = None, now: float | None = None, manifest=None) -> Goodput | None:
    """The goodput of a recorded run (nodectl.runs.Run): its timeline, its pace windows, and, while it runs, rank 0's
    heartbeat as a poll just read it (`live_beat`) for the current attempt. `manifest`: the record as the caller
    read it already."""
    manifest = manifest or run.read()
    entries = Timeline(run.folder).entries()
    beats = beats_of(entries)
    if live_beat and _real(live_beat.get("time")):
        beats[manifest.attempt] = {**beats.get(manifest.attempt, {}), **live_beat}
        if not any(e["what"] == "first step" and e["attempt"] == manifest.attempt for e in entries) \
                and _real(live_beat.get("first_step_at")):   # no watcher saw it (detached): the rank's own word
            entries.append({"time": live_beat["first_step_at"], "what": "first step", "attempt": manifest.attempt,
                            **({"step": live_beat["first_step"]} if _real(live_beat.get("first_step")) else {})})
    windows = jsonl_objects(run.folder / "pace.jsonl")
    ended = manifest.ended if manifest.state.value not in ("running", "starting") else None
    return ledger(entries, now=now or time.time(), ended=ended, pace_windows=windows, beats=beats)


def story(manifest, spent: Goodput | None) -> list[str]:
    """A restarted run's attempts, a line each: how each ended, the nodes left out, where the next went on from
    and what it did again. Nothing for a run of one attempt."""
    earlier = [a for a in manifest.attempts if isinstance(a, dict)]
    if not earlier:
        return []
    seen = {a.get("attempt"): a for a in (spent.attempts if spent else ())}
    lines = []
    for record in earlier + [{"attempt": manifest.attempt, "state": manifest.state.value, "failure": manifest.failure}]:
        number = record.get("attempt")
        failure = record.get("failure") if isinstance(record.get("failure"), dict) else None
        said = f"attempt {number}: {record.get('state')}"
        if failure and failure.get("description"):
            said += f" ({failure['description']})"
        ledger_row = seen.get(number) or {}
        if ledger_row.get("continued_from") is not None:
            said += f"; went on from step {ledger_row['continued_from']}"
            if ledger_row.get("redone_s"):
                said += f", {span(ledger_row['redone_s'])} of work done again"
        lines.append(said)
    left = [entry.get("node", {}).get("name") for entry in manifest.left_out if isinstance(entry, dict)]
    if left:
        lines.append(f"left out: {', '.join(str(n) for n in left if n)}")
    return lines
