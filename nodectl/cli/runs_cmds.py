"""Shared helpers of the commands that act on a recorded run (tail, status, stop, stacks, collect)."""
from __future__ import annotations

import click

from nodectl.cli.context import AppContext
from nodectl.runs import FINAL_STATES, Run, open_run
from nodectl.watch import derive_state


def run_option(fn):
    return click.option("--run", "run_id", metavar="RUN", help="Run id or a unique prefix (default: the latest).")(fn)


def opened(app: AppContext, run_id: str | None) -> Run:
    return open_run(run_id)


def refresh_state(run: Run, states: dict) -> str | None:
    """Correct a recorded state that only the nodes can settle: an attached controller that was killed leaves
    "starting" or "running", and nobody watches a detached run end. Final states stay as recorded."""
    manifest = run.manifest()
    recorded = manifest.get("state")
    if recorded in FINAL_STATES:
        return recorded
    derived = derive_state(states)
    if derived and derived != recorded:
        fields = {"state": derived}
        if derived != "running":
            fields["ended"] = manifest.get("ended") or max(
                ((r.value or {}).get("launcher_exit") or {}).get("time", 0) for r in states.values()) or None
        run.update(**fields)
        return derived
    return recorded
