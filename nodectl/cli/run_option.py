"""Shared helpers of the commands that act on a recorded run (tail, status, stop, stacks, collect)."""
from __future__ import annotations

import time

import click
from rich.markup import escape

from nodectl.cli.context import AppContext
from nodectl.runs import Run, RunState, controller_gone, open_run, untrusted_records
from nodectl.watch import derive_state


def run_option(fn):
    return click.option("--run", "run_id", metavar="RUN", help="Run id or a unique prefix (default: the latest).")(fn)


def opened(app: AppContext, run_id: str | None) -> Run:
    warn_untrusted(app)
    return open_run(run_id)


def warn_untrusted(app: AppContext) -> None:
    """Say, once a command, which run records under ./runs are ignored as not the user's own."""
    foreign = untrusted_records()
    if foreign:
        names = ", ".join(folder.name for folder in foreign[:4]) + (", ..." if len(foreign) > 4 else "")
        app.err.print(f"[yellow]warning:[/] ignored {len(foreign)} run record(s) under {foreign[0].parent}/ that "
                      f"nodectl did not record for this user (a cloned project's?): {escape(names)}; nothing in "
                      f"them is read or acted on")


NEVER_STARTED = {"kind": "controller", "description": "nodectl ended (killed?) while it was starting the run: no "
                 "node started it; `nodectl stop` removes what it had prepared on the nodes"}


def never_started(states: dict) -> bool:
    """Every node answered, and none has started the run (no run folder, or one prepared and never started)."""
    for result in states.values():
        if result.ok:
            if result.value.started:
                return False
        elif not result.no_run:
            return False
    return bool(states)


def refresh_state(run: Run, states: dict) -> RunState:
    """Correct a recorded state that only the nodes can settle: an attached controller that was killed leaves
    "starting" or "running", and nobody watches a detached run end. Final states stay as recorded."""
    manifest = run.read()
    if manifest.state.final:
        return manifest.state
    if manifest.state == RunState.STARTING and controller_gone(manifest) and never_started(states):
        run.update(state=RunState.FAILED, ended=time.time(), failure=NEVER_STARTED)
        return RunState.FAILED
    derived = derive_state(states)
    if derived and derived != manifest.state:
        changes = {"state": derived}
        if derived != RunState.RUNNING:
            changes["ended"] = manifest.ended or max(
                (r.value.launcher_exit.time if r.ok and r.value.launcher_exit else 0) for r in states.values()) or None
        run.update(**changes)
        return derived
    return manifest.state
