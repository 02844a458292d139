"""Preflight as a launch's gate (nodectl/launch/gate.py's protocol): the quick tier before a start and for the nodes
a restart keeps, a recent passing report reused, and the history a run's pace is set against and its straggler
verdicts kept in. The CLI hands it to the launch, so launch/ needs nothing of preflight/."""
from __future__ import annotations

from typing import Callable

from nodectl.inventory import Inventory
from nodectl.preflight.checks import Tier
from nodectl.preflight.history import History
from nodectl.preflight.host import UNSAFE_FIX
from nodectl.preflight.run import PreflightReport, reusable, save
from nodectl.preflight.sequence import preflight
from nodectl.runs import state_dir
from nodectl.transport import Session


class PreflightGate:
    unsafe_fix = UNSAFE_FIX

    def reusable(self, inventory: Inventory, gpus: int | None) -> dict | None:
        return reusable(inventory, gpus)

    def check(self, inventory: Inventory, session: Session, gpus: int | None,
              on_probe: Callable[[], None]) -> PreflightReport:
        return preflight(inventory, session, tier=Tier.QUICK, gpus=gpus, on_probe=on_probe, keep=False).report

    def save(self, report: PreflightReport, inventory: Inventory, gpus: int | None) -> None:
        save(report, inventory, gpus)

    def remember_straggler(self, run_id: str, straggler: dict) -> None:
        try:
            History(state_dir()).add_straggler(run_id, straggler)
        except OSError:
            pass   # the registry is a convenience: a read-only home must not end the watch

    def remember_failure(self, run_id: str, failure: dict) -> None:
        try:
            History(state_dir()).add_failure(run_id, failure)
        except OSError:
            pass   # as above: the record of the run is its manifest

    def remember_hardware(self, run_id: str, node: str, event) -> None:
        try:
            History(state_dir()).add_hardware(run_id, node, event)
        except OSError:
            pass   # as above

    def latest_allreduce(self, nodes: list[str]) -> dict | None:
        try:
            return History(state_dir()).latest_allreduce(nodes)
        except OSError:
            return None
