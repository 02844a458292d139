"""Which processes are a run's: its cgroup, its process tree, the markers in its environment; signals through a pidfd."""
from __future__ import annotations

import os
import signal
import time

from runctl.common import open_run_file, read_json


# A cgroup per run and node, where the login may make one (root, or a delegated hierarchy): membership is
# inherited by every process the run starts and cannot be shed by setsid, a double fork, a cleared environment
# or the death of launch.sh, so `stop` finds what escaped the process tree too. Only to track: no controller is
# enabled, no limit set. cgroup v2 where mounted, else v1's controller-less name=systemd hierarchy, else pids.
GROUPS_FOLDER = "nodectl"
GROUP_SWEEP_AGE = 60   # seconds: an empty group older than this is a finished run's, removed at the next start


def _hierarchies() -> list:
    """[(mount point, key)] of the cgroup hierarchies to try, best first; key is what /proc/PID/cgroup names the
    hierarchy by ("" for v2)."""
    found = []
    try:
        with open("/proc/self/mounts", encoding="utf-8") as handle:
            mounts = [line.split() for line in handle]
    except OSError:
        return []
    for fields in mounts:
        if len(fields) >= 4 and fields[2] == "cgroup2":
            found.append((0, fields[1], ""))
        elif len(fields) >= 4 and fields[2] == "cgroup":
            options = fields[3].split(",")
            if "name=systemd" in options:
                found.append((1, fields[1], "name=systemd"))
            elif "pids" in options:
                found.append((2, fields[1], "pids"))
    return [(mount, key) for _, mount, key in sorted(found)]


def new_run_group(name: str):
    """{"dir", "key", "path"} of a new cgroup for this run on this node, or None where none can be made."""
    for mount, key in _hierarchies():
        base = os.path.join(mount, GROUPS_FOLDER)
        try:
            os.makedirs(base, exist_ok=True)
            _sweep_groups(base)
            folder = os.path.join(base, name)
            os.mkdir(folder)
        except OSError:
            continue
        return {"dir": folder, "key": key, "path": "/" + GROUPS_FOLDER + "/" + name}
    return None


def _sweep_groups(base: str) -> None:
    """Remove the empty groups of runs that ended (rmdir refuses a group with a process in it)."""
    for entry in os.listdir(base):
        folder = os.path.join(base, entry)
        try:
            if time.time() - os.stat(folder).st_mtime > GROUP_SWEEP_AGE:
                os.rmdir(folder)
        except OSError:
            continue


def join_group(group: dict) -> None:
    """In launch.sh's process before it runs: enter the run's group (a failure leaves the subreaper alone)."""
    try:
        with open(os.path.join(group["dir"], "cgroup.procs"), "w", encoding="utf-8") as handle:
            handle.write("0")
    except OSError:
        pass


def in_group(pid: int, group: dict) -> bool:
    """Whether a process is in the run's group (or below it), by its own /proc/PID/cgroup."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return False
    for line in lines:
        _, keys, path = (line.split(":", 2) + ["", ""])[:3]
        if (keys == group["key"] or (group["key"] and group["key"] in keys.split(","))) and \
                (path == group["path"] or path.startswith(group["path"] + "/")):
            return True
    return False


def group_of(run_dir: str):
    """The run's cgroup as start recorded it, only when it is one runctl makes: <mount>/nodectl/<run id>-<node
    rank> of a hierarchy mounted here, its path that group's own (never empty: "" would match every process)."""
    group = read_json(os.path.join(run_dir, "state", "cgroup"))
    node = read_json(os.path.join(run_dir, "node.json"))
    if not (isinstance(group, dict) and all(isinstance(group.get(k), str) for k in ("dir", "key", "path"))
            and isinstance(node, dict)):
        return None
    name = f"{node.get('run_id')}-{node.get('node_rank')}"
    made = {(os.path.join(mount, GROUPS_FOLDER, name), key) for mount, key in _hierarchies()}
    if (group["dir"], group["key"]) in made and group["path"] == f"/{GROUPS_FOLDER}/{name}":
        return group
    return None


def _group_members(group) -> set:
    if not group:
        return set()
    try:
        with open(os.path.join(group["dir"], "cgroup.procs"), encoding="utf-8") as handle:
            return {int(line) for line in handle if line.strip().isdigit()}
    except OSError:
        return set()


def remove_group(group) -> None:
    if group:
        try:
            os.rmdir(group["dir"])
        except OSError:
            pass


def become_subreaper() -> None:
    """In launch.sh's process, before it runs: orphaned descendants (a rank's child that double-forks, calls
    setsid and clears its environment) are reparented to launch.sh instead of init, so they stay in the run's
    process tree, where `stop` finds them whatever they did to their environment (Linux 3.4+; elsewhere a no-op,
    and the environment markers alone apply)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)   # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _parents() -> dict:
    """pid -> parent pid of every process."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8") as handle:
                    out[int(entry)] = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return out


def _launcher(run_dir: str, markers: tuple):
    """launch.sh's pid while it lives and is this run's (its environment proves it), else None."""
    try:
        with open_run_file(os.path.join(run_dir, "state", "pgid")) as handle:
            pid = int(handle.read())
    except (OSError, ValueError):
        return None
    return pid if belongs(pid, markers) and not is_zombie(pid) else None


def _descendants(root: int, parents: dict) -> set:
    children: dict = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _proc_environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            return handle.read()
    except OSError:
        return b""


def run_markers(run_dir: str) -> tuple:
    node = read_json(os.path.join(run_dir, "node.json"), {})
    return (f"NODECTL_RUN_ID={node.get('run_id')}".encode(), f"NODECTL_NODE_RANK={node.get('node_rank')}".encode())


def belongs(pid: int, markers: tuple) -> bool:
    """Proof that a pid is a process of this run on this node: its environment carries the run id and node rank
    (runctl starts launch.sh with them and every process of the run inherits them). A recorded pid or process
    group alone proves nothing: after a reboot or a wrap-around the number may name someone else's process."""
    environ = _proc_environ(pid).split(b"\0")
    return all(marker in environ for marker in markers)


def run_processes(run_dir: str) -> list:
    """Live pids of this node's share of the run (never this helper itself): those whose environment carries
    the run's markers, every descendant of its launch.sh (a subreaper: see become_subreaper), and every member
    of the run's cgroup where it has one (new_run_group)."""
    markers = run_markers(run_dir)
    parents = _parents()
    launcher = _launcher(run_dir, markers)
    tree = _descendants(launcher, parents) | {launcher} if launcher else set()
    tree |= _group_members(group_of(run_dir))
    pids = [pid for pid in parents if pid != os.getpid()]
    return [pid for pid in pids if (pid in tree or belongs(pid, markers)) and not is_zombie(pid)]


def _ours(pid: int, markers: tuple, run_dir) -> bool:
    if belongs(pid, markers):
        return True
    group = group_of(run_dir) if run_dir else None
    if group and in_group(pid, group):
        return True
    launcher = _launcher(run_dir, markers) if run_dir else None
    return bool(launcher) and pid in _descendants(launcher, _parents())


def signal_run_process(pid: int, signum: int, markers: tuple, run_dir: str | None = None) -> bool:
    """Send a signal only to a pid proven to be the run's (its environment, or descent from the run's live
    launch.sh), through a pidfd where the kernel has them, so the pid cannot be reused between the proof and
    the signal."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    try:
        if not _ours(pid, markers, run_dir):
            return False
        if fd is not None:
            signal.pidfd_send_signal(fd, signum)
        else:
            os.kill(pid, signum)
        return True
    except (ProcessLookupError, PermissionError):
        return False
    finally:
        if fd is not None:
            os.close(fd)


def is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


class Proven:
    """Processes proven the run's (`_ours`) when first seen, each held by a pidfd where the kernel has them: a
    pidfd names that process and no other, so it can be signalled after it left the cgroup, the process tree
    or its environment, and never hits a process that took its pid after it died."""

    def __init__(self, run_dir: str, markers: tuple) -> None:
        self.run_dir, self.markers = run_dir, markers
        self.held: dict = {}   # pid -> pidfd (None where the kernel has none: then re-proven at each signal)

    def add(self, pids: list) -> list:
        for pid in pids:
            if pid in self.held:
                continue
            try:
                fd = os.pidfd_open(pid)
            except (AttributeError, OSError):
                fd = None
            if _ours(pid, self.markers, self.run_dir):
                self.held[pid] = fd
            elif fd is not None:
                os.close(fd)
        return list(self.held)

    def _gone(self, pid: int, fd) -> bool:
        if fd is None:
            return not _ours(pid, self.markers, self.run_dir) or is_zombie(pid)
        try:
            signal.pidfd_send_signal(fd, 0)
        except ProcessLookupError:
            return True
        except OSError:
            pass
        return is_zombie(pid)

    def alive(self) -> list:
        return [pid for pid, fd in self.held.items() if not self._gone(pid, fd)]

    def signal(self, signum: int) -> None:
        for pid in self.alive():
            fd = self.held[pid]
            try:
                if fd is not None:
                    signal.pidfd_send_signal(fd, signum)
                else:
                    signal_run_process(pid, signum, self.markers, self.run_dir)
            except (ProcessLookupError, PermissionError, OSError):
                continue

    def close(self) -> None:
        for fd in self.held.values():
            if fd is not None:
                os.close(fd)
        self.held.clear()
