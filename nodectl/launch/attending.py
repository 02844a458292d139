"""How an attached launch watches its run, each option declared once: a field of `Attending` is the request's
value, the run record's (`Manifest.attending`, which --resume reads back) and, through its `option(...)`
metadata, the command line's (cli/launch.py makes one click option of each field). None of it reaches a node:
the plan (nodectl/plan.py) is what the nodes run, this is what nodectl does while they run it."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping

from nodectl.errors import UsageError


@dataclass(frozen=True)
class Option:
    """A field's command-line option: its flag, its help, and what it takes (`seconds` from `low` up, a `count`
    from 0, a `flag`, or one of `choices`)."""

    flag: str
    help: str
    kind: str
    low: float = 0
    choices: tuple[str, ...] = ()


def option(default: Any, flag: str, help: str, kind: str, low: float = 0, choices: tuple[str, ...] = ()) -> Any:
    return field(default=default, metadata={"option": Option(flag, help, kind, low, choices)})


@dataclass(frozen=True)
class Attending:
    """What `nodectl launch` does while its run runs: how it stops one, whether and how it restarts it, what a
    stall and a straggler make it do."""

    grace: float = option(10.0, "--grace", "Seconds between SIGTERM and SIGKILL when stopping.", "seconds")
    max_restarts: int = option(
        0, "--max-restarts", "After a failure, stop the run everywhere and start it again as its next attempt, up "
        "to N times (the built-in trainer continues from its latest checkpoint). Needs an attached launch.", "count")
    exclude_failed: bool = option(
        False, "--exclude-failed", "With --max-restarts: before each restart, run the quick preflight on the run's "
        "nodes and leave out the ones that fail it or are lost; the run goes on with the rest.", "flag")
    lost_after: float = option(
        60.0, "--lost-after", "A node whose watch stream stays silent this many seconds, and three times its own "
        "longest silence so far, is lost (its SSH port refusing connections is lost at once; a slow node is shown "
        "with its lag and never stopped). --connect-timeout only bounds connecting.", "seconds", low=1)
    stall_after: float | None = option(
        None, "--stall-after", "A live rank whose heartbeat is older than this many seconds (or, for a script that "
        "writes none, whose log has not grown for that long) stalls: the run is diagnosed (nodectl diagnose) and "
        "stopped.", "seconds", low=1)
    on_stall: str = option(
        "stop", "--on-stall", "With --stall-after: after the diagnosis, stop the run, or keep it running (to attach "
        "a debugger, or wait it out).", "choice", choices=("stop", "keep"))
    on_straggler: str = option(
        "warn", "--on-straggler", "When one rank stays 15% slower than the others (the straggler verdict): say so, "
        "or, with --max-restarts, once the verdict has held for --straggler-hold seconds stop the run, leave its "
        "node out and resume on the rest from the latest checkpoint.", "choice", choices=("warn", "exclude"))
    resume_only: bool = option(
        False, "--resume-only", "With --max-restarts: restart only where the next attempt continues from a "
        "checkpoint (the built-in trainer's, complete on every node of it). Where none is seen, say what would be "
        "done again and do not restart: a failed run ends as it is, and --on-straggler exclude lets the run go on "
        "with its straggler.", "flag")
    straggler_hold: float = option(
        60.0, "--straggler-hold", "With --on-straggler exclude: seconds a straggler verdict must hold before its "
        "node is left out.", "seconds")

    @property
    def keep_stalled(self) -> bool:
        return self.on_stall == "keep"

    @classmethod
    def take(cls, options: dict) -> "Attending":
        """The fields' values out of a command's options (removed from them), by the fields' names."""
        return cls(**{f.name: options.pop(f.name) for f in fields(cls) if f.name in options})

    def check(self, detach: bool) -> None:
        """A usage error (exit 2) for options that cannot go together."""
        if self.exclude_failed and not self.max_restarts:
            raise UsageError("--exclude-failed decides which nodes a restart uses: give --max-restarts N too")
        if self.resume_only and not self.max_restarts:
            raise UsageError("--resume-only decides whether a restart happens: give --max-restarts N too")
        if self.on_straggler == "exclude" and not self.max_restarts:
            raise UsageError("--on-straggler exclude resumes the run without the straggler's node: give "
                             "--max-restarts N too")
        if self.on_straggler == "exclude" and detach:
            raise UsageError("--on-straggler exclude needs an attached launch: nodectl itself watches the ranks' "
                             "pace (drop --detach)")
        if self.on_stall == "keep" and not self.stall_after:
            raise UsageError("--on-stall keep says what to do with a stall: give --stall-after SECONDS too")
        if self.stall_after and detach:
            raise UsageError("--stall-after needs an attached launch: nodectl itself watches the heartbeats (on a "
                             "detached run, `nodectl status --stall-after S` and `nodectl diagnose`)")
        if self.max_restarts and detach:
            raise UsageError("--max-restarts needs an attached launch: nodectl itself watches the run and restarts "
                             "it (drop --detach)")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_record(cls, document: Any, source: str) -> "Attending":
        """A recorded value read back as the command line would have taken it: each field of its kind and range,
        or a UsageError naming it; a field missing takes its default (a record of an older version)."""
        if document is None:
            return cls()
        if not isinstance(document, Mapping):
            raise UsageError(f"{source}: attending: expected a mapping")
        values = {}
        for f in fields(cls):
            if f.name not in document:
                continue
            value, spec = document[f.name], f.metadata["option"]
            if value is None and f.default is None:
                values[f.name] = None
            elif spec.kind == "flag" and isinstance(value, bool):
                values[f.name] = value
            elif spec.kind == "choice" and value in spec.choices:
                values[f.name] = value
            elif spec.kind == "count" and isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                values[f.name] = value
            elif spec.kind == "seconds" and isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and math.isfinite(value) and value >= spec.low:
                values[f.name] = float(value)
            else:
                raise UsageError(f"{source}: attending.{f.name}: not what {spec.flag} takes ({value!r})")
        return cls(**values)
