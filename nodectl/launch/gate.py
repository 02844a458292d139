"""What a launch asks of preflight, handed to it as a value: the quick check before a start (reused when a recent
one passed), the check of the nodes a restart keeps, and the history a run's pace is set against and its straggler
verdicts kept in. nodectl/preflight/gate.py is the real one (the CLI gives it); launch/ imports nothing of
preflight/, which launches its own collective jobs through launch/ with no gate."""
from __future__ import annotations

from typing import Callable, Protocol

from nodectl.inventory import Inventory
from nodectl.transport import Session


class GateReport(Protocol):
    """A quick preflight's outcome as the launch reads it."""
    unreachable: dict
    failed: list
    reports: dict

    def to_json(self) -> dict: ...


class Gate(Protocol):
    unsafe_fix: str   # the hint of a failed `workdir` check that makes the refusal a usage error (exit 2)

    def reusable(self, inventory: Inventory, gpus: int | None) -> dict | None:
        """A passing report of these nodes from the last few minutes, or None."""

    def check(self, inventory: Inventory, session: Session, gpus: int | None,
              on_probe: Callable[[], None]) -> GateReport:
        """The quick preflight of `inventory` now."""

    def save(self, report: GateReport, inventory: Inventory, gpus: int | None) -> None:
        """The report kept, for `reusable` and preflight's history."""

    def remember_straggler(self, run_id: str, straggler: dict) -> None:
        """A run's straggler verdict kept in preflight's history (the next preflight names the node)."""

    def remember_failure(self, run_id: str, failure: dict) -> None:
        """An attempt's failure on a node kept in preflight's history (`preflight --history NODE` shows it)."""

    def remember_hardware(self, run_id: str, node: str, event) -> None:
        """A part's event during a run (nodectl.remote.answers.HardwareEvent) kept in preflight's history: the next
        preflight names a part that failed during runs."""

    def latest_allreduce(self, nodes: list[str]) -> dict | None:
        """What preflight's all-reduce gave on exactly these nodes last, or None."""


class NoGate:
    """No preflight: for preflight's own collective jobs (launched with skip_preflight), and callers that have
    no history. `check` is never asked of it."""
    unsafe_fix = ""

    def reusable(self, inventory: Inventory, gpus: int | None) -> dict | None:
        return None

    def check(self, inventory: Inventory, session: Session, gpus: int | None,
              on_probe: Callable[[], None]) -> GateReport:
        raise RuntimeError("a launch without a preflight gate was asked to check its nodes")

    def save(self, report: GateReport, inventory: Inventory, gpus: int | None) -> None:
        return None

    def remember_straggler(self, run_id: str, straggler: dict) -> None:
        return None

    def remember_failure(self, run_id: str, failure: dict) -> None:
        return None

    def remember_hardware(self, run_id: str, node: str, event) -> None:
        return None

    def latest_allreduce(self, nodes: list[str]) -> dict | None:
        return None


NO_GATE = NoGate()
