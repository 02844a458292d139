"""Making one rank slow, as a shared or limited machine does: a CPU quota on its process (a cgroup of its own, v1 or
v2), or another process spinning on the one core it is pinned to, for the straggler tests and
bench/watch/straggler.py."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import psutil

V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")


def rank_process(run_id: str, rank: int, script: str) -> psutil.Process | None:
    """The program of `rank` of run `run_id` (its own process, not rankexec.py that started it)."""
    for proc in psutil.process_iter():
        try:
            env, argv = proc.environ(), proc.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if env.get("NODECTL_RUN_ID") == run_id and env.get("RANK") == str(rank) \
                and any(script in a for a in argv) and not any("rankexec" in a for a in argv):
            return proc
    return None


def quota_available() -> bool:
    return (V1 / "cpu.cfs_quota_us").exists() or (V2 / "cgroup.controllers").exists()


@contextlib.contextmanager
def cpu_quota(pid: int, share: float):
    """Every thread of `pid` held to `share` of one CPU while inside; its cgroup removed after."""
    name = f"nodectl-slow-{os.getpid()}-{pid}"
    if (V1 / "cpu.cfs_quota_us").exists():
        group = V1 / name
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text(str(int(100000 * share)))
        members, home = group / "tasks", V1 / "tasks"
        threads = [t.id for t in psutil.Process(pid).threads()]
    else:
        group = V2 / name
        group.mkdir()
        (group / "cpu.max").write_text(f"{int(100000 * share)} 100000")
        members, home = group / "cgroup.procs", V2 / "cgroup.procs"
        threads = [pid]
    try:
        for tid in threads:
            with contextlib.suppress(ProcessLookupError, OSError):
                members.write_text(str(tid))
        yield group
    finally:
        with contextlib.suppress(OSError):
            for tid in members.read_text().split():
                with contextlib.suppress(OSError):
                    home.write_text(tid)
        with contextlib.suppress(OSError):
            group.rmdir()


HOG = "while True:\n    pass\n"


@contextlib.contextmanager
def cpu_hog(pid: int):
    """`pid` (all its threads) pinned to one core, and another process spinning there while inside, in a cgroup of
    its own weighted 10 times the rank's (the rank's run has a cgroup of its own, and cgroups share a core by their
    weights, whatever the niceness; at equal weights the rank, which needs a sixth of a CPU, kept its pace): the
    rank waits on its run queue as on a node whose cores someone else's job takes. Yields the spinning process."""
    core = max(os.sched_getaffinity(0))
    threads = [t.id for t in psutil.Process(pid).threads()]
    before = {tid: os.sched_getaffinity(tid) for tid in threads}
    hog = subprocess.Popen([sys.executable, "-c", HOG], env={k: v for k, v in os.environ.items()
                                                              if not k.startswith("NODECTL_")})
    name = f"nodectl-hog-{os.getpid()}-{hog.pid}"
    if (V1 / "cpu.shares").exists():
        group, members = V1 / name, V1 / name / "tasks"
        group.mkdir()
        (group / "cpu.shares").write_text(str(1024 * 10))
    else:
        group, members = V2 / name, V2 / name / "cgroup.procs"
        group.mkdir()
        (group / "cpu.weight").write_text("1000")
    try:
        members.write_text(str(hog.pid))
        os.sched_setaffinity(hog.pid, {core})
        for tid in threads:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, {core})
        yield hog
    finally:
        hog.kill()
        hog.wait()
        for tid, cores in before.items():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, cores)
        with contextlib.suppress(OSError):
            group.rmdir()
