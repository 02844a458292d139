"""The one preflight sequence: the probe's checks, the tier's collective jobs, the figures against their own past
and the nodes that held back earlier runs, the report kept. `nodectl preflight` runs it at the tier asked for; a
launch's gate (gate.py) and the check of the nodes a restart keeps run it at `Tier.QUICK`."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nodectl.inventory import Inventory
from nodectl.preflight.checks import Tier
from nodectl.preflight.collective_job import DEFAULT_DEADLINE_S, add_collectives
from nodectl.preflight.history import DRIFT_FAIL, DRIFT_WARN, Drift, History, judge_hardware, judge_stragglers
from nodectl.preflight.run import PreflightReport, compare_with_history, run_preflight, save
from nodectl.progress import NodeProgress
from nodectl.transport import Session


@dataclass
class Checked:
    report: PreflightReport
    drift: Drift                 # the figures against their past (empty without a history, or at Tier.QUICK)
    saved: Path | None = None    # where the report was kept (None: `keep` was off)


def preflight(inventory: Inventory, session: Session, *, tier: Tier, gpus: int | None,
              on_probe: NodeProgress | None = None, deadline: float | None = DEFAULT_DEADLINE_S,
              history: History | None = None, drift: tuple[float, float] = (DRIFT_WARN, DRIFT_FAIL),
              keep: bool = True) -> Checked:
    """Check `inventory`'s nodes at `tier`. With `history`, measured figures are judged against their own past
    (and added to it) and the nodes named in earlier runs' straggler verdicts are warned of; with `keep`, the
    report is saved where a launch's gate reuses it."""
    report = run_preflight(inventory, session, gpus=gpus, tier=tier, on_probe=on_probe)
    phase = on_probe.phase if on_probe is not None else (lambda text: None)
    add_collectives(report, inventory, session, gpus=gpus, tier=tier, deadline=deadline, phase=phase)
    judged = Drift()
    if history is not None:
        judged = compare_with_history(report, history, *drift)
        report.results += judge_stragglers(report.nodes, history.entries())
        report.results += judge_hardware(report.nodes, history.entries())
    return Checked(report, judged, save(report, inventory, gpus) if keep else None)
