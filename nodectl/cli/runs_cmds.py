"""Shared helpers of the commands that act on a recorded run (tail, status, stop, stacks, collect)."""
from __future__ import annotations

import click

from nodectl.cli.context import AppContext
from nodectl.runs import Run, open_run


def run_option(fn):
    return click.option("--run", "run_id", metavar="RUN", help="Run id or a unique prefix (default: the latest).")(fn)


def opened(app: AppContext, run_id: str | None) -> Run:
    return open_run(run_id)
