"""Stopping a run: SIGTERM to every process proven the run's, SIGKILL after the grace period."""
from __future__ import annotations

import json
import os
import shutil
import signal
import time

import runlayout as layout
from runctl.common import is_file, lstat_nofollow, no_run, write_file
from runctl.containers import remove_container
from runctl.processes import Proven, forget, group_of, remove_group, run_markers, run_processes, seen_processes, \
    unproven


def cmd_stop(args: list, request: dict) -> dict:
    """SIGTERM every process of this node's share of the run, SIGKILL what is left after the grace period."""
    run_dir, grace = os.path.expanduser(args[0]), float(request.get("grace", 10))
    if not os.path.isdir(run_dir):
        return no_run(run_dir)
    if request.get("unstarted") and not is_file(os.path.join(run_dir, layout.PGID)) \
            and not (is_file(os.path.join(run_dir, layout.NODE_JSON)) and run_processes(run_dir)):
        # prepared (or half-prepared) by a launch given up before it started here: removed only when no earlier
        # attempt ever ran in it; a resumed run's folder keeps its attempts, outputs and checkpoints, byte for byte
        if _holds_earlier_attempts(run_dir):
            return {"time": time.time(), "terminated": 0, "killed": 0, "left": 0, "kept": True}
        shutil.rmtree(run_dir, ignore_errors=True)
        return {"time": time.time(), "terminated": 0, "killed": 0, "left": 0, "removed": True}
    if not is_file(os.path.join(run_dir, layout.NODE_JSON)):
        return no_run(run_dir)
    # Every process proven the run's is held by a pidfd from then on: one that leaves the proof behind while
    # stop waits (a rank that left the cgroup, cleared its environment and double-forked, whose subreaper
    # launch.sh exits on SIGTERM, so it is reparented to init) is still the one proven, and still ended.
    # What escaped every proof after launch.sh died is still the run's where a poll saw it (seen_processes).
    proven = Proven(run_dir, run_markers(run_dir))
    try:
        targets = proven.add(run_processes(run_dir) + seen_processes(run_dir))
        proven.signal(signal.SIGTERM)
        deadline = time.time() + grace
        while proven.alive() and time.time() < deadline:
            time.sleep(0.1)
            proven.add(run_processes(run_dir))
        killed = proven.alive()
        proven.signal(signal.SIGKILL)
        for _ in range(50):
            proven.add(run_processes(run_dir))
            if not proven.alive():
                break
            proven.signal(signal.SIGKILL)
            time.sleep(0.1)
        left = proven.alive()
        doubtful = unproven(run_dir, set(proven.held))
    finally:
        proven.close()
    stopped = {"time": time.time(), "terminated": len(targets), "killed": len(killed)}
    if doubtful:
        stopped["unproven"] = doubtful
    if not left:
        remove_group(group_of(run_dir))
        if not doubtful:
            forget(run_dir)
    removed = remove_container(run_dir)
    if removed:
        stopped["container"] = removed
    if targets:
        write_file(os.path.join(run_dir, layout.STOPPED), json.dumps(stopped))
    return dict(stopped, left=len(left))


def _holds_earlier_attempts(run_dir: str) -> bool:
    """An earlier attempt ran here (archived under attempts/), or output/ holds anything (a checkpoint, files
    filled or pulled for a resume): what a given-up launch must never delete."""
    if lstat_nofollow(os.path.join(run_dir, "attempts")) is not None:
        return True
    try:
        return bool(os.listdir(os.path.join(run_dir, "output")))
    except OSError:
        return False
