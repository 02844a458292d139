"""Stopping a run: SIGTERM to every process proven the run's, SIGKILL after the grace period."""
from __future__ import annotations

import json
import os
import shutil
import signal
import time

from runctl.common import write_file
from runctl.containers import remove_container
from runctl.processes import group_of, remove_group, run_markers, run_processes, signal_run_process


def cmd_stop(args: list, request: dict) -> dict:
    """SIGTERM every process of this node's share of the run, SIGKILL what is left after the grace period."""
    run_dir, grace = os.path.expanduser(args[0]), float(request.get("grace", 10))
    if not os.path.isdir(run_dir):
        return {"error": f"no run at {run_dir}"}
    if request.get("unstarted") and not os.path.exists(os.path.join(run_dir, "state", "pgid")) \
            and not (os.path.exists(os.path.join(run_dir, "node.json")) and run_processes(run_dir)):
        shutil.rmtree(run_dir, ignore_errors=True)   # prepared (or half-prepared) by a controller that died
        return {"time": time.time(), "terminated": 0, "killed": 0, "left": 0, "removed": True}
    if not os.path.exists(os.path.join(run_dir, "node.json")):
        return {"error": f"no run at {run_dir}"}
    markers = run_markers(run_dir)
    targets = run_processes(run_dir)
    for pid in targets:
        signal_run_process(pid, signal.SIGTERM, markers, run_dir)
    deadline = time.time() + grace
    left = targets
    while left and time.time() < deadline:
        time.sleep(0.1)
        left = [pid for pid in run_processes(run_dir)]
    killed = list(left)
    for pid in left:
        signal_run_process(pid, signal.SIGKILL, markers, run_dir)
    time.sleep(0.05)
    for _ in range(50):
        if not run_processes(run_dir):
            break
        time.sleep(0.1)
    stopped = {"time": time.time(), "terminated": len(targets), "killed": len(killed)}
    if not run_processes(run_dir):
        remove_group(group_of(run_dir))
    removed = remove_container(run_dir)
    if removed:
        stopped["container"] = removed
    if targets:
        write_file(os.path.join(run_dir, "state", "stopped"), json.dumps(stopped))
    return dict(stopped, left=len(run_processes(run_dir)))
