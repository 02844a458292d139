"""What the library tells a progress display while it works on nodes; the CLI's bar implements it
(cli/context.py `node_progress`), and a caller without a display passes nothing."""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager, Protocol


class NodeProgress(Protocol):
    """Called once per node as each finishes (a fan-out's `on_done`); `phase(text)` names a step that is not
    counted in nodes (preflight's all-reduce test), so a wait never sits on a finished "2/2"."""

    def __call__(self, result) -> None: ...

    def phase(self, text: str) -> None: ...


# progress(label, total) -> a context that yields the NodeProgress advanced once per node (the CLI's bar)
Progress = Callable[[str, int], ContextManager[NodeProgress]]


class _Silent:
    def __call__(self, result) -> None:
        pass

    def phase(self, text: str) -> None:
        pass


def no_progress(label: str, total: int) -> ContextManager[NodeProgress]:
    return nullcontext(_Silent())
