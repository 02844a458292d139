"""Which processes are a run's: its cgroup, its process tree, the markers in its environment; signals through a pidfd."""
from __future__ import annotations

import json
import os
import signal
import time

import runlayout as layout
from runctl.common import Unsafe, open_run_file, read_json, trusted_path, write_file


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


def cgroups_of(pid: int) -> list[tuple[str, str]] | None:
    """(controllers, path) of each line of the process's /proc/PID/cgroup ("" for cgroup v2); None when gone."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    return [tuple((line.split(":", 2) + ["", ""])[1:3]) for line in lines]


def in_group(pid: int, group: dict) -> bool:
    """Whether a process is in the run's group (or below it), by its own /proc/PID/cgroup."""
    for keys, path in cgroups_of(pid) or ():
        if (keys == group["key"] or (group["key"] and group["key"] in keys.split(","))) and \
                (path == group["path"] or path.startswith(group["path"] + "/")):
            return True
    return False


def group_of(run_dir: str):
    """The run's cgroup as start recorded it, only when it is one runctl makes: <mount>/nodectl/<run id>-<node
    rank> of a hierarchy mounted here, its path that group's own (never empty: "" would match every process)."""
    group = read_json(os.path.join(run_dir, layout.CGROUP))
    node = read_json(os.path.join(run_dir, layout.NODE_JSON))
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
        with open_run_file(os.path.join(run_dir, layout.PGID)) as handle:
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
    node = read_json(os.path.join(run_dir, layout.NODE_JSON), {})
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


def _stat(pid: int) -> list:
    """/proc/PID/stat's fields after the command name (fields[0] is the state), [] for a process that is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def started_at(pid: int):
    """When a process started (seconds since the epoch), None when it is gone."""
    fields = _stat(pid)
    if len(fields) < 20:
        return None
    return _boot_time() + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def _boot_time() -> float:
    with open("/proc/stat", encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("btime "):
                return float(line.split()[1])
    return 0.0


def _run_window(run_dir: str) -> tuple:
    """(start, end) of this node's share of the run: when runctl started launch.sh (its own record, below), and
    when launch.sh's exit was recorded (now while there is none)."""
    start = _kept(run_dir).get("start")
    record = read_json(os.path.join(run_dir, layout.LAUNCHER_EXIT))
    end = record.get("time") if isinstance(record, dict) and isinstance(record.get("time"), (int, float)) else None
    return (start if isinstance(start, (int, float)) else None), end or time.time()


# What runctl keeps about a run for `stop`, where no rank can write: <workdir>/.nodectl/kept/ (the run folder's
# state/ is written by the ranks, a container's root included, and a container sees the host's pids). It holds
# when launch.sh started and what each poll saw: pid -> start time of every process proven the run's then. A
# process that later leaves every proof (its cgroup, launch.sh's tree once launch.sh died, its environment) is
# still the same process while its pid names one with that start time, and only one that began after the run
# did counts.
KEPT_LIMIT = 4096
KEPT_AGE = 30 * 86400   # seconds: records of runs older than this are swept at the next start


def _kept_path(run_dir: str):
    """<workdir>/.nodectl/kept/<run id>[--<node>].json, None for a folder not shaped as a run's."""
    parts = os.path.expanduser(run_dir).rstrip("/").split("/")
    if "runs" not in parts[:-1]:
        return None
    at = len(parts) - 1 - parts[::-1].index("runs")
    folder = trusted_path("/".join(parts[:at]) or "/", (".nodectl", "kept"))
    return os.path.join(folder, "--".join(parts[at + 1:]) + ".json")


def _kept(run_dir: str) -> dict:
    try:
        path = _kept_path(run_dir)
        kept = read_json(path, {}) if path else {}
    except (OSError, Unsafe):
        return {}
    return kept if isinstance(kept, dict) else {}


def keep_start(run_dir: str) -> None:
    """Called by `start` as it starts launch.sh; sweeps the records of long-finished runs."""
    path = _kept_path(run_dir)
    if path is None:
        return
    folder, now = os.path.dirname(path), time.time()
    for name in os.listdir(folder):
        try:
            if now - os.lstat(os.path.join(folder, name)).st_mtime > KEPT_AGE:
                os.unlink(os.path.join(folder, name))
        except OSError:
            continue
    write_file(path, json.dumps({"start": now, "seen": {}}), 0o600)


def record_seen(run_dir: str, pids: list) -> None:
    kept = _kept(run_dir)
    seen = kept.get("seen")
    if not isinstance(seen, dict) or not isinstance(kept.get("start"), (int, float)):
        return
    fresh = {str(pid): began for pid in pids if (began := started_at(pid)) is not None}
    if any(seen.get(pid) != began for pid, began in fresh.items()):
        seen.update(fresh)
        try:
            write_file(_kept_path(run_dir), json.dumps(dict(kept, seen=dict(list(seen.items())[-KEPT_LIMIT:]))),
                       0o600)
        except (OSError, Unsafe):
            pass


def seen_processes(run_dir: str) -> list:
    """Live pids that a poll proved the run's: the same process (its start time), begun after the run started."""
    kept = _kept(run_dir)
    seen, start = kept.get("seen"), kept.get("start")
    if not isinstance(seen, dict) or not isinstance(start, (int, float)):
        return []
    found = []
    for pid, recorded in seen.items():
        if not pid.isdigit() or not isinstance(recorded, (int, float)):
            continue
        began = started_at(int(pid))
        if began is not None and abs(began - recorded) < 0.05 and began >= start - 1 and not is_zombie(int(pid)):
            found.append(int(pid))
    return found


def forget(run_dir: str) -> None:
    try:
        path = _kept_path(run_dir)
        if path:
            os.unlink(path)
    except (OSError, Unsafe):
        pass


def unproven(run_dir: str, proven: set) -> list:
    """Processes nodectl cannot prove the run's and leaves alone, named so the user can look: this user's, begun
    while the run ran, left to init (parent pid 1), no terminal, no run's markers in their environment. A process
    that cleared its environment, left the cgroup and double-forked before any poll saw it, after launch.sh
    died, looks like this; so may a daemon the user started meanwhile, which is why they are named, not signalled."""
    start, end = _run_window(run_dir)
    if start is None:
        return []
    mine, found = os.getuid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in proven or int(entry) == os.getpid():
            continue
        pid, fields = int(entry), _stat(int(entry))
        try:
            if len(fields) < 20 or fields[0] == "Z" or fields[1] != "1" or fields[4] != "0" or \
                    os.stat(f"/proc/{pid}").st_uid != mine or b"NODECTL_RUN_ID=" in _proc_environ(pid):
                continue
            with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as handle:
                name = handle.read().strip()
        except OSError:
            continue
        began = started_at(pid)
        if began is not None and start - 1 <= began <= end + 1:
            found.append({"pid": pid, "name": name[:32], "started": round(began, 1)})
    return found[:20]


def _ours(pid: int, markers: tuple, run_dir) -> bool:
    if belongs(pid, markers):
        return True
    if run_dir and pid in seen_processes(run_dir):
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
