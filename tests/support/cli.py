"""nodectl as a user runs it: a separate process, its real exit code, stdout and stderr apart."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class CLIResult:
    exit_code: int
    stdout: str
    stderr: str

    def json(self):
        return json.loads(self.stdout)

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def run_nodectl(args: list[str], env: dict | None = None, cwd: Path | None = None, timeout: float = 180,
                input: str | None = None, umask: int | None = None) -> CLIResult:
    """nodectl as a user runs it: a separate process, its real exit code, stdout and stderr apart; with `umask`,
    the user's (a permissive 022 shows which files nodectl makes private itself)."""
    try:
        proc = subprocess.run([sys.executable, "-m", "nodectl", *args], capture_output=True, text=True,
                              env=env or os.environ.copy(), cwd=cwd, timeout=timeout, input=input,
                              preexec_fn=None if umask is None else (lambda: os.umask(umask)))
    except subprocess.TimeoutExpired as exc:  # a hung command fails its test with what it had printed
        said = [(part.decode(errors="replace") if isinstance(part, bytes) else part or "")[-4000:]
                for part in (exc.stdout, exc.stderr)]
        raise AssertionError(f"nodectl {' '.join(args)} did not end in {timeout:.0f} s\nstdout: {said[0]}\n"
                             f"stderr: {said[1]}") from None
    return CLIResult(proc.returncode, proc.stdout, proc.stderr)


def nodectl_in(folder: Path, *args: str, env: dict | None = None, timeout: float = 180,
               umask: int | None = None) -> CLIResult:
    """nodectl run in `folder`, its state and run records kept under it (a user of its own)."""
    env = {**os.environ, **(env or {}), "NODECTL_STATE_DIR": str(folder / "state"),
           "NODECTL_RUNS": str(folder / "runs")}
    return run_nodectl(list(args), env=env, cwd=folder, timeout=timeout, umask=umask)
