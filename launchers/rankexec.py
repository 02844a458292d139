#!/usr/bin/env python3
"""What torchrun starts for each rank: the user's program with its output in logs/rank<R>.log.

torchrun runs `python -u rankexec.py SCRIPT ARGS...` (or `-m MODULE ARGS...`). This wrapper starts the program
as its child with the same environment, forwards signals to it, and records the child's pid and, when it ends,
its exit code with the time (state/rank<R>.exit), which is how nodectl tells the first failing rank. The child dies
with it (Linux's parent-death signal): a wrapper killed by SIGKILL or the OOM killer leaves no rank training on
into the next attempt's folder. It imports nothing beyond the standard library and nothing from nodectl.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time

import runlayout as layout   # beside this file in lib/: the run folder's names, written once
from nodeio import write_file

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)


def _request_fifo(path: str) -> str:
    """The FIFO that `nodectl diagnose` writes to and the listener in the rank (lib/sitecustomize.py) reads;
    "" (no listener) where it cannot be made."""
    try:
        if os.path.lexists(path):
            os.unlink(path)
        os.mkfifo(path, 0o600)
        return path
    except OSError:
        return ""


def _dies_with(parent: int):
    """What the child runs before its program: SIGKILL once `parent` is gone (prctl PR_SET_PDEATHSIG), and an exit
    where it is gone already. Nothing where the C library has no prctl (not Linux)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def arm() -> None:
        prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(128 + signal.SIGKILL)

    return arm


def main() -> int:
    run_dir, rank = os.environ["NODECTL_RUN_DIR"], os.environ["RANK"]
    at = lambda relative: os.path.join(run_dir, relative)  # noqa: E731
    env = dict(os.environ, NODECTL_STACK_FILE=at(layout.rank_stack(rank)), NODECTL_METRICS=at(layout.rank_metrics(rank)))
    lib = os.path.dirname(os.path.abspath(__file__))  # nodectl_metrics.py, after the program's own paths
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), lib) if p)
    env["NODECTL_RANK_HELPER"] = _request_fifo(at(layout.rank_request(rank)))
    exit_file = at(layout.rank_exit(rank))
    write_file(at(layout.rank_wrapper(rank)), str(os.getpid()))   # while it lives, a missing exit is still coming
    if os.path.exists(exit_file):  # torchrun restarted this rank (--max-restarts): keep the earlier exit aside
        os.replace(exit_file, f"{exit_file}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', 'prev')}")
    with open(at(layout.rank_log(rank)), "ab", buffering=0) as log:
        child = subprocess.Popen([sys.executable, "-u", *sys.argv[1:]], stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=env, preexec_fn=_dies_with(os.getpid()))
    for signum in FORWARDED:
        signal.signal(signum, lambda sig, _frame: child.send_signal(sig))
    write_file(at(layout.rank_pid(rank)), str(child.pid))
    code = child.wait()
    write_file(exit_file, json.dumps({"code": code, "time": time.time()}))
    if code < 0:  # died of a signal: die of the same one, so torchrun sees what happened
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
