"""Host checks: what a node's operating system gives the ranks (torch importable, limits, /dev/shm, disk,
workdir, clock). Pure functions of the probe report (launchers/probe.py)."""
from __future__ import annotations

from typing import Mapping

from nodectl.preflight.verdict import FAIL, PASS, SKIP, WARN, CheckResult, get, gib, skip_if_unreadable, unreadable

SHM_MIN = 1 << 30


DISK_WARN, DISK_FAIL = 20 << 30, 2 << 30


SKEW_WARN, SKEW_FAIL = 1.0, 30.0


NOFILE_FAIL, NOFILE_WARN = 1024, 65536


def check_torch(node: str, report: Mapping, device: str) -> CheckResult:
    torch = report.get("torch") or {}
    python = get(report, "python", "executable", default="python3")
    if "error" in torch:
        return CheckResult("torch", node, FAIL, f"torch does not import for {python}: {torch['error']}",
                           f"install it into that interpreter: {python} -m pip install torch (the CUDA build "
                           f"your driver supports), or set python: in hosts.yaml to one that has it")
    if device == "cuda" and torch.get("imported") and not torch.get("cuda_available"):
        return CheckResult("torch", node, FAIL, f"torch {torch.get('version')} sees no CUDA device",
                           "install a CUDA build of torch (not +cpu), check the driver with nvidia-smi, or use "
                           "device: cpu for this node")
    return CheckResult("torch", node, PASS, f"torch {torch.get('version')} (CUDA {torch.get('cuda') or '-'}, "
                                            f"NCCL {torch.get('nccl') or '-'})")


@skip_if_unreadable("memlock", "limits")
def check_memlock(node: str, report: Mapping) -> CheckResult:
    soft = get(report, "limits", "memlock_soft")
    if not report.get("infiniband"):
        return CheckResult("memlock", node, SKIP if soft != "unlimited" else PASS,
                           f"memlock {soft} (only matters with InfiniBand)")
    if soft != "unlimited":
        return CheckResult("memlock", node, FAIL, f"memlock is {soft} bytes with InfiniBand present",
                           "add '* soft memlock unlimited' and '* hard memlock unlimited' to "
                           "/etc/security/limits.conf (LimitMEMLOCK=infinity for services), then log in again")
    return CheckResult("memlock", node, PASS, "unlimited")


@skip_if_unreadable("nofile", "limits")
def check_nofile(node: str, report: Mapping) -> CheckResult:
    """Open files: every rank holds sockets to its peers (NCCL, gloo, the TCP store), data loader workers share
    tensors through descriptors; 1024 is soon spent at scale, a few hundred at once."""
    soft, hard = get(report, "limits", "nofile_soft"), get(report, "limits", "nofile_hard")
    if soft is None:
        return CheckResult("nofile", node, SKIP, "the probe did not read the open-files limit")
    fix = ("add '* soft nofile 1048576' and '* hard nofile 1048576' to /etc/security/limits.conf "
           "(LimitNOFILE=1048576 for services), then log in again")
    if soft != "unlimited" and soft < NOFILE_FAIL:
        return CheckResult("nofile", node, FAIL, f"open files limited to {soft} (hard {hard})", fix)
    if soft != "unlimited" and soft < NOFILE_WARN:
        return CheckResult("nofile", node, WARN, f"open files limited to {soft} (hard {hard})", fix)
    return CheckResult("nofile", node, PASS, f"{soft} open files")


@skip_if_unreadable("shm", "disk")
def check_shm(node: str, report: Mapping) -> CheckResult:
    shm = get(report, "disk", "shm_bytes")
    if shm is None:
        return CheckResult("shm", node, FAIL, "/dev/shm is missing", "mount a tmpfs on /dev/shm")
    if shm < SHM_MIN:
        return CheckResult("shm", node, FAIL, f"/dev/shm is {gib(shm)}",
                           "at least 1 GiB: in docker use --shm-size=16g or --ipc=host; else "
                           "mount -o remount,size=16G /dev/shm")
    return CheckResult("shm", node, PASS, gib(shm))


@skip_if_unreadable("disk", "disk")
def check_disk(node: str, report: Mapping) -> CheckResult:
    free = get(report, "disk", "free_bytes")
    where = get(report, "disk", "workdir", default="workdir")
    if free is None:
        return CheckResult("disk", node, SKIP, "free space could not be read")
    if free < DISK_FAIL:
        return CheckResult("disk", node, FAIL, f"{gib(free)} free in {where}", "free space or move workdir:")
    if free < DISK_WARN:
        return CheckResult("disk", node, WARN, f"{gib(free)} free in {where}", "checkpoints may not fit")
    return CheckResult("disk", node, PASS, f"{gib(free)} free")


def check_workdir(node: str, report: Mapping) -> CheckResult:
    """The workdir must take the run folders: created and written by the login user."""
    reason = unreadable(report, "disk")
    disk = report.get("disk") or {}
    if reason or "writable" not in disk:
        return CheckResult("workdir", node, SKIP, reason or "writability not probed")
    where = disk.get("workdir", "workdir")
    if not disk["writable"]:
        return CheckResult("workdir", node, FAIL, f"{where} cannot be written ({disk.get('write_error')})",
                           "set workdir: in hosts.yaml to a folder the login user owns (e.g. ~/nodectl or a local "
                           "scratch disk), or fix its owner and mode")
    return CheckResult("workdir", node, PASS, f"{where} writable")


def check_clock(node: str, report: Mapping) -> CheckResult:
    skew = get(report, "clock", "skew_s")
    if skew is None:
        return CheckResult("clock", node, SKIP, "no clock reading")
    slack = (get(report, "clock", "round_trip_s", default=0) or 0) / 2
    effective = max(0.0, abs(skew) - slack)
    hint = "run chrony or systemd-timesyncd on every node; logs and heartbeats are compared by time"
    if effective > SKEW_FAIL:
        return CheckResult("clock", node, FAIL, f"{skew:+.1f}s from the controller", hint)
    if effective > SKEW_WARN:
        return CheckResult("clock", node, WARN, f"{skew:+.1f}s from the controller", hint)
    return CheckResult("clock", node, PASS, f"{skew:+.2f}s")
