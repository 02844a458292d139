"""Ranks' log lines as people read them: `[node/rank]` and a colour per rank when several ranks are followed."""
from __future__ import annotations

from typing import Callable

from rich.markup import escape

from nodectl.terminal_text import visible

COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "bright_red", "bright_cyan", "bright_magenta")


def printer(console, ranks: dict[int, str], prefixed: bool) -> Callable[[int, str], None]:
    """A LogStream's sink that prints each line on `console` (control characters made visible, markup escaped)."""
    def show(rank: int, line: str) -> None:
        if prefixed:
            label = escape(f"[{ranks[rank]}/{rank}]")
            console.print(f"[{COLOURS[rank % len(COLOURS)]}]{label}[/] {escape(visible(line))}")
        else:
            console.print(escape(visible(line)))
    return show
