"""State shared by every command through click's ctx.obj: global options, the consoles, the inventory."""
from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from rich.console import Console

from nodectl.inventory import Inventory, load_inventory, resolve_inventory_path
from nodectl.transport import Cluster, NodeResult, Session, TransportOptions


PIPED_WIDTH = 1000


def _piped_width() -> int | None:
    """On a terminal, its width; piped (grep, a file, a CI log), tables keep their rows on one line instead of
    wrapping at rich's default 80 columns. COLUMNS, where set, wins."""
    return None if sys.stdout.isatty() or os.environ.get("COLUMNS") else PIPED_WIDTH


@dataclass
class AppContext:
    inventory_option: str | None = None
    verbose: int = 0
    quiet: bool = False
    json: bool = False
    transport_options: TransportOptions = field(default_factory=TransportOptions)
    out: Console = field(default_factory=lambda: Console(highlight=False, soft_wrap=True, width=_piped_width()))
    err: Console = field(default_factory=lambda: Console(stderr=True, highlight=False, soft_wrap=True))
    _said_local: bool = False

    def inventory(self, positional: str | None = None) -> Inventory:
        path = resolve_inventory_path(positional or self.inventory_option)
        if path is None and not self._said_local:
            self._said_local = True
            self.info("no hosts.yaml here (nor -i FILE, nor $NODECTL_INVENTORY): using this machine as the node "
                      "(transport: local)")
        return load_inventory(path)

    def cluster(self, inventory: Inventory) -> Cluster:
        return Cluster(inventory.nodes, self.transport_options)

    def cluster_for(self, run_nodes) -> Cluster:
        return Cluster([rn.node for rn in run_nodes], self.transport_options)

    def session(self) -> Session:
        """One set of connections shared by a command's steps (launch, preflight, stop), with the progress bar."""
        return Session(self.transport_options, self.node_progress)

    def info(self, message: str) -> None:
        """Progress and notes: stderr, so --json keeps stdout clean."""
        if not self.quiet:
            self.err.print(message)

    def heading(self, text: str) -> None:
        """A section title: a rule across the terminal, or one short line when piped."""
        if self.out.is_terminal:
            self.out.rule(text, align="left", characters="-")
        else:
            self.out.print(f"---- {text} ----")

    def emit_json(self, document: Any) -> None:
        sys.stdout.write(json.dumps(document, indent=2, default=str, sort_keys=False) + "\n")
        sys.stdout.flush()

    @contextmanager
    def node_progress(self, label: str, total: int) -> Iterator:
        """A progress bar on stderr over `total` nodes; yields the callback that advances it. Its `phase(label)`
        starts a step that is not counted in nodes (a collective test): the bar pulses with that label and the
        elapsed time keeps running, so no wait sits on a finished "2/2". (rich.progress is loaded here, by the
        commands that draw a bar.)"""
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                                   TimeElapsedColumn)

        progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=self.err, transient=True,
                            disable=self.quiet or not self.err.is_terminal)
        with progress:
            yield _Bar(progress, progress.add_task(label, total=total))


class _Bar:
    """The bar as the library's NodeProgress (nodectl/progress.py)."""

    def __init__(self, progress, task) -> None:
        self.progress, self.task = progress, task

    def __call__(self, result: NodeResult) -> None:
        self.progress.advance(self.task)

    def phase(self, text: str) -> None:
        self.progress.update(self.task, description=text, total=None, completed=0)
