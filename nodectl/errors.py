"""User-facing errors and the exit codes of docs/REFERENCE.md §2.

Anything raised that is not one of these is a bug in nodectl and may show a traceback.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

EXIT_OK = 0
EXIT_FAILED = 1        # a check failed or the run failed
EXIT_USAGE = 2         # usage or inventory error
EXIT_UNREACHABLE = 3   # a node could not be reached
EXIT_INTERRUPTED = 130


def exit_code_for(results) -> int:
    """The one rule from per-node outcomes (NodeResults) to a command's exit code: 3 when any node could not be
    reached, 2 when a node refused a folder the inventory points at as unsafe (the node-side trust rule), 1 when a
    node answered with another error, else 0."""
    results = list(results)
    if any(r.unreachable for r in results):
        return EXIT_UNREACHABLE
    if any(getattr(r.failure, "kind", None) == "unsafe" for r in results):
        return EXIT_USAGE
    return EXIT_FAILED if any(not r.ok for r in results) else EXIT_OK


class NodectlError(Exception):
    """A problem the user can act on; the CLI prints it as 'Error: <message>' and exits with the class's code."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def format_message(self) -> str:
        return self.message


class UsageError(NodectlError):
    exit_code = EXIT_USAGE


class InventoryError(UsageError):
    """Something wrong in hosts.yaml: names the file, the line where known, the key and what was expected."""

    def __init__(self, path: str, key: str, expected: str, line: int | None = None) -> None:
        where = f"{path}:{line}" if line else path
        super().__init__(f"{where}: {key}: {expected}")
        self.path, self.key, self.line = path, key, line


class UnreachableError(NodectlError):
    exit_code = EXIT_UNREACHABLE


class RunFailed(NodectlError):
    exit_code = EXIT_FAILED


class Cancelled(Exception):
    """Work on a node given up because the user interrupted; the node was left as it was before."""


class Flag:
    """A one-way flag that a signal handler may set. threading.Event's set() takes a lock: a handler that runs
    while its own thread holds that lock (inside Event.wait, or another handler's set) waits for itself forever,
    which is how Ctrl-C during a launch once hung nodectl for good, SIGTERM included. Here set() and is_set()
    are one attribute write and read (atomic under the GIL)."""

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


# Set the moment SIGINT or SIGTERM arrives, before the KeyboardInterrupt unwinds anything: threads working on
# nodes read it to stop before their next step (nothing new starts once the user asked to stop).
INTERRUPTED = Flag()


def _on_signal(signum, frame) -> None:
    INTERRUPTED.set()   # no lock taken in a signal handler
    raise KeyboardInterrupt


def install_signal_handlers() -> None:
    """SIGTERM behaves as Ctrl-C does: every command stops what it started, then exits 130."""
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)


@contextmanager
def _signals_handled_by(handler) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():   # only the main thread can set handlers
        yield
        return
    previous = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])


def interruptible():
    """Ctrl-C and SIGTERM raise KeyboardInterrupt inside the block, also where the caller ignores them while it
    cleans up (a second Ctrl-C can then hurry the clean-up); the caller's handlers are restored after it."""
    return _signals_handled_by(_on_signal)


def uninterruptible():
    """Ctrl-C and SIGTERM are ignored inside the block (a clean-up with its own timeouts); restored after it."""
    return _signals_handled_by(signal.SIG_IGN)


def ignore_signals_while_cleaning() -> None:
    """A second Ctrl-C must not cut the clean-up short (it has its own timeouts)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
