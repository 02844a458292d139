"""User-facing errors and the exit codes of SPEC §2.

Anything raised that is not one of these is a bug in nodectl and may show a traceback.
"""
from __future__ import annotations

import click

EXIT_OK = 0
EXIT_FAILED = 1        # a check failed or the run failed
EXIT_USAGE = 2         # usage or inventory error
EXIT_UNREACHABLE = 3   # a node could not be reached
EXIT_INTERRUPTED = 130


class NodectlError(click.ClickException):
    """A problem the user can act on; printed as 'Error: <message>' with the class's exit code."""

    exit_code = EXIT_FAILED


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


class Interrupted(NodectlError):
    exit_code = EXIT_INTERRUPTED
