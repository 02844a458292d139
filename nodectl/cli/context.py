"""State shared by every command through click's ctx.obj: global options, the consoles, the inventory."""
from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from nodectl.inventory import Inventory, load_inventory, resolve_inventory_path
from nodectl.transport import Cluster, NodeResult, TransportOptions


@dataclass
class AppContext:
    inventory_option: str | None = None
    verbose: int = 0
    quiet: bool = False
    json: bool = False
    transport_options: TransportOptions = field(default_factory=TransportOptions)
    out: Console = field(default_factory=lambda: Console(highlight=False, soft_wrap=True))
    err: Console = field(default_factory=lambda: Console(stderr=True, highlight=False, soft_wrap=True))

    def inventory(self, positional: str | None = None) -> Inventory:
        return load_inventory(resolve_inventory_path(positional or self.inventory_option))

    def cluster(self, inventory: Inventory) -> Cluster:
        return Cluster(inventory.nodes, self.transport_options)

    def cluster_for(self, run_nodes) -> Cluster:
        return Cluster([rn.node for rn in run_nodes], self.transport_options)

    def info(self, message: str) -> None:
        """Progress and notes: stderr, so --json keeps stdout clean."""
        if not self.quiet:
            self.err.print(message)

    def emit_json(self, document: Any) -> None:
        sys.stdout.write(json.dumps(document, indent=2, default=str, sort_keys=False) + "\n")
        sys.stdout.flush()

    @contextmanager
    def node_progress(self, label: str, total: int) -> Iterator:
        """A progress bar on stderr over `total` nodes; yields the callback that advances it."""
        progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=self.err, transient=True,
                            disable=self.quiet or not self.err.is_terminal)
        with progress:
            task = progress.add_task(label, total=total)

            def advance(result: NodeResult) -> None:
                progress.advance(task)

            yield advance
