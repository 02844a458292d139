"""What a launch tells its caller as it goes (`launch(..., events=...)`), one type per happening. The pipeline
prints nothing; the CLI turns each event into its lines (nodectl/cli/launch_output.py), preflight's collective
test ignores them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from nodectl.watch import Failure


@dataclass(frozen=True)
class EnvironmentsReady:
    """Stage.PROVISION: every node's venv built or reused."""
    provisioned: Any         # nodectl.remote.envs.Provisioned
    seconds: float


@dataclass(frozen=True)
class PreflightReused:
    """Stage.PREFLIGHT: a passing report of the same nodes from the last 10 minutes stands in for a new one."""


@dataclass(frozen=True)
class PreflightProbing:
    """Stage.PREFLIGHT: the quick preflight is reading every node."""
    count: int


@dataclass(frozen=True)
class PreflightFailed:
    """Stage.PREFLIGHT: a node failed the quick preflight; the launch stops (the error follows as an exception)."""
    report: Any              # nodectl.preflight.run.PreflightReport


@dataclass(frozen=True)
class Planned:
    """The last stage was Stage.PLAN (a dry run): the rendered scripts, and what only the nodes could settle."""
    job: Any                 # nodectl.launch.job.Job
    unsettled: tuple[str, ...]


@dataclass(frozen=True)
class SharedWorkdirs:
    """Stage.SETTLE: these nodes' workdirs are one storage (a network home); each gets its own run folder."""
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class Recorded:
    """Stage.RECORD: the run folder holds the plan; `resumed` when it is a recorded run's next attempt."""
    job: Any
    resumed: bool


@dataclass(frozen=True)
class CodeReady:
    """Stage.START: every node has its code and run folder; nothing started yet."""
    nodes: int
    seconds: float
    sent: int


@dataclass(frozen=True)
class Started:
    """Stage.START: every node started the run."""
    job: Any
    run: Any                 # nodectl.runs.Run


@dataclass(frozen=True)
class Stopping:
    """A rank failed (or a node was lost, or a rank stalled): the run is being stopped on every node."""
    failure: Failure


@dataclass(frozen=True)
class NotAnswering:
    """A node did not confirm the stop: its processes may live on."""
    node: str
    run_id: str


@dataclass(frozen=True)
class Restarting:
    run_id: str
    failure: Failure
    attempt: int          # the attempt about to start
    restarts_left: int


@dataclass(frozen=True, kw_only=True)
class Continuing:
    """What a restart costs: the step the next attempt continues from (the built-in trainer's newest checkpoint
    every node of it holds complete; None: none seen) and the step the last attempt reached."""
    run_id: str
    attempt: int
    checkpoint: int | None
    reached: int | None
    builtin: bool          # the built-in trainer (whose checkpoints nodectl can see), not the user's script


@dataclass(frozen=True)
class NotRestarting:
    """--resume-only: the next attempt would not continue from a checkpoint, so there is none. `straggler`: the
    exclusion of a straggler's node was held back (the run goes on), else the failed run ends as it is."""
    continuing: Continuing
    straggler: bool = False


@dataclass(frozen=True)
class CheckingNodes:
    """--exclude-failed: the quick preflight on the run's nodes before a restart."""
    run_id: str
    count: int


@dataclass(frozen=True)
class LeavingOut:
    node: str
    why: str


@dataclass(frozen=True)
class AttemptRecorded:
    run_id: str
    attempt: int
    nnodes: int


@dataclass(frozen=True)
class Diagnosed:
    """A rank stalled: why, across every rank (nodectl/diagnose/), before the run is stopped or while it is kept."""
    failure: Failure
    diagnosis: object       # nodectl.diagnose.gather.Diagnosis, or None when gathering it failed
    kept: bool              # --on-stall keep: the run goes on
    error: str = ""


@dataclass(frozen=True)
class StragglerSeen:
    """The pace verdict (nodectl/pace.py): a rank the others wait for, or (its `ended` set) one that keeps pace
    again."""
    straggler: Any           # nodectl.pace.Straggler


@dataclass(frozen=True)
class StragglerHeldBack:
    """--on-straggler exclude did not leave the straggler's node out: its verdict rests only on the timings other
    ranks report of themselves (`straggler.basis` says why); the run goes on, and no part is blamed in the
    history."""
    straggler: Any           # nodectl.pace.Straggler


@dataclass(frozen=True)
class UploadTrouble:
    """A node's uploader (outputs:) says it could not send: told once per node and message; the run goes on."""
    node: str
    error: str


@dataclass(frozen=True)
class HardwareSeen:
    """A part of a node did something while the run ran (an Xid, a counter that rose, a GPU lost): told once, and
    again when it rises further. A fatal one also ends the run as its failure."""
    node: str
    line: str
    fatal: bool


@dataclass(frozen=True)
class HardwareNote:
    """What a node could not read of its hardware (its kernel log), or a counter that was reset: told once."""
    node: str
    note: str


@dataclass(frozen=True)
class RunPace:
    """Every rank is slower than the run's own healthy pace, no single rank to blame."""
    line: str


@dataclass(frozen=True, kw_only=True)
class NodeLiveness:
    """Stage.ATTEND: nodes whose watch streams fell behind their usual pace in one tick of the watch (slow, each
    with its lag), or caught up again (up). Slow is not lost: nothing is stopped for it."""
    nodes: tuple[str, ...]
    state: str                       # nodectl.remote.liveness.Liveness: up, slow
    details: tuple[str, ...] = ()    # for slow: each node's lag, in the order of `nodes`


@dataclass(frozen=True)
class Interrupting:
    """Ctrl-C or SIGTERM after the run was recorded: whatever may have started is being stopped."""
    run_id: str


@dataclass(frozen=True)
class Interrupted:
    """The interrupted run stopped (KeyboardInterrupt follows): per node, what the stop did."""
    run_id: str
    stopped: Mapping[str, Any]   # node -> NodeResult[StopAnswer]
    hurried: bool                # a second Ctrl-C: SIGKILL without the grace period


Event = (EnvironmentsReady | PreflightReused | PreflightProbing | PreflightFailed | Planned | SharedWorkdirs
         | Recorded | CodeReady | Started | Stopping | NotAnswering | Restarting | Continuing | NotRestarting | CheckingNodes | LeavingOut
         | AttemptRecorded | Diagnosed | StragglerSeen | StragglerHeldBack | RunPace | UploadTrouble | HardwareSeen | HardwareNote
         | NodeLiveness
         | Interrupting | Interrupted)
Listener = Callable[[Event], None]


def ignore(event: Event) -> None:
    pass
