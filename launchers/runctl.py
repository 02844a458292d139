#!/usr/bin/env python3
"""Node-side helper for one run folder: prepare, start, poll, stop, stacks, logs, pack.

nodectl installs this file once per version under <workdir>/.nodectl/ and calls it over SSH with argv and a
JSON document on stdin; it answers with one JSON document on stdout. Standard library only; imports nothing
from nodectl. A run's processes are the ones whose environment carries this run's NODECTL_RUN_ID and node rank:
torchrun starts each rank in a session of its own, so one process group is not enough, and a recorded pid or
group number is never trusted alone (after a reboot it may name another process). Signals go through a pidfd
after that proof, so `stop` gets all of the run's processes and nothing else.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tarfile
import time

STATE_DIRS = ("code", "lib", "logs", "state", "heartbeat", "stacks", "output", "flight", "timing", "metrics")
READ_LIMIT = 256 * 1024


# The node-side trust rule, in this one place: runctl acts as the login user (often root) on what it finds under
# the workdir, so every folder it keeps there (.nodectl/ and its store, venvs and tools; runs/, each run folder)
# is made by it with mode 0700, is never reached through a link, and is the login user's, writable by nobody
# else. The workdir itself (a folder the user named, perhaps through a link) is the login user's or root's, and
# where others may write in it (a shared /scratch), it has the sticky bit, so nobody else can rename or remove
# what nodectl keeps there. Inside folders that hold, no other user can plant, swap or link a file, so what a run
# folder holds (node.json, state/, flight/, logs/) was written by this user's runs. Anything else is refused,
# before it is used, naming the folder, its owner and the fix.
class Unsafe(Exception):
    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"{path} is {why}")
        self.path, self.why = path, why


class NotARun(Exception):
    """A path that is not shaped as a run folder: runctl acts on none (a record may name any path)."""


def _owner(uid: int) -> str:
    try:
        import pwd
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def trusted_workdir(workdir: str, create: bool = True) -> bool:
    """Whether the workdir exists (made 0700 when missing and `create`); Unsafe when another user could swap what
    nodectl keeps in it."""
    if create:
        os.makedirs(workdir, mode=0o700, exist_ok=True)
    try:
        info = os.stat(workdir)   # the workdir may be reached through a link the user chose
    except FileNotFoundError:
        return False
    if info.st_uid not in (os.getuid(), 0):
        raise Unsafe(workdir, f"owned by {_owner(info.st_uid)}, not by you ({_owner(os.getuid())}) or root: that user "
                              f"could rename or replace what nodectl keeps in it")
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        raise Unsafe(workdir, f"writable by other users (mode {oct(info.st_mode & 0o7777)}) without the sticky bit: "
                              f"they could rename or replace what nodectl keeps in it")
    return True


def own_folder(path: str, create: bool = True) -> bool:
    """A folder nodectl keeps: made 0700 when missing (and `create`), else checked. False when it is missing."""
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(info.st_mode):
        raise Unsafe(path, f"a symbolic link (to {os.readlink(path)}), not a folder nodectl made: another user may "
                           f"have planted it")
    if not stat.S_ISDIR(info.st_mode):
        raise Unsafe(path, "not a folder")
    if info.st_uid != os.getuid():
        raise Unsafe(path, f"owned by {_owner(info.st_uid)}, not by you ({_owner(os.getuid())}): another user made it "
                           f"first")
    if info.st_mode & 0o022:   # the user's own, made wider by a umask of 002 (an older nodectl's): narrowed
        os.chmod(path, 0o700)
    return True


def trusted_path(workdir: str, parts: tuple, create: bool = True) -> str:
    """<workdir>/<parts...>, the workdir and each folder below it checked (and made, with `create`)."""
    workdir = os.path.expanduser(workdir)
    path = workdir
    if trusted_workdir(workdir, create):
        for part in parts:
            path = os.path.join(path, part)
            if not own_folder(path, create):
                break
    return os.path.join(workdir, *parts)


def trusted_run_dir(run_dir: str, create: bool = False) -> str:
    """A run folder, <workdir>/runs/<run id>[/<node>], with the rule applied from the workdir down."""
    run_dir = os.path.expanduser(run_dir).rstrip("/")
    parts = run_dir.split("/")
    for depth in (1, 2):   # <run id>, or <run id>/<node> where nodes share a workdir's disk
        if len(parts) > depth + 1 and parts[-depth - 1] == "runs" and all(p not in ("", ".", "..") for p in parts[-depth:]):
            workdir = "/".join(parts[:-depth - 1]) or "/"
            return trusted_path(workdir, ("runs", *parts[-depth:]), create)
    raise NotARun(run_dir)


def _guard(name: str, args: list, request: dict) -> None:
    """Apply the trust rule to the folders `name` is about to use, before it uses them."""
    if name in ("have", "receive"):
        trusted_path(args[0], (".nodectl", "objects"))
        if name == "receive" and isinstance(request.get("prepare"), dict):   # the run folder, in the same call
            _guard("prepare", [], request["prepare"])
    elif name == "prepare":
        trusted_path(request["workdir"], (".nodectl", "objects"))
        trusted_run_dir(request["run_dir"], create=True)
    elif name in ("identity", "env_status"):
        trusted_path(args[0], (".nodectl",))
    elif name == "env_build":
        trusted_path(args[0], (".nodectl", "envs"))
    elif name in ("start", "poll", "tail", "stop", "stacks", "diagnose", "pack", "fill", "pull"):
        trusted_run_dir(args[0])


def _read_json(path: str, default=None):
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError, RecursionError):   # deeply nested JSON is malformed, not a crash
        return default


def _write(path: str, text: str, mode: int = 0o644) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


# Store objects carry this mtime. Run folders hard-link them (one write per byte on the node, not two), so a
# program that writes into its own code file in place changes the object too: its mtime then differs, and the
# object counts as missing (sent again under a new inode) instead of handing a later run the changed bytes.
STORE_MTIME = 946684800  # 2000-01-01


def _intact(path: str, size) -> bool:
    try:
        stat = os.stat(path)
    except OSError:
        return False
    return int(stat.st_mtime) == STORE_MTIME and (size is None or stat.st_size == size)


def cmd_have(args: list, request: dict) -> dict:
    """Which of the given content hashes the node's object store lacks (or holds changed since it arrived)."""
    store = os.path.join(os.path.expanduser(args[0]), ".nodectl", "objects")
    sizes = request.get("sizes") or {}
    return {"missing": [h for h in request["hashes"] if not _intact(os.path.join(store, h), sizes.get(h))]}


def _private_copy(source, path: str, executable: bool = False) -> tuple:
    """Copy a readable stream into a file only the user can read (0600, or 0700 for a program), whatever the
    source's mode was: a 0644 credentials file in the project must not become readable by other users of the
    node. Streams in 1 MiB blocks; returns the content's sha256."""
    mode = 0o700 if executable else 0o600
    tmp = f"{path}.{os.getpid()}.tmp"
    digest = hashlib.sha256()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            for block in iter(lambda: source.read(1 << 20), b""):
                digest.update(block)
                handle.write(block)
        os.chmod(tmp, mode)
    except BaseException:
        os.unlink(tmp)
        raise
    return digest.hexdigest(), tmp


STREAM_BUFFER = 1 << 20  # tarfile's default of 10 KiB reads took a third of the receive time in system calls


def _hash_file(path: str) -> str:
    digest, block = hashlib.sha256(), bytearray(STREAM_BUFFER)
    view = memoryview(block)
    with open(path, "rb", buffering=0) as handle:
        while True:
            count = handle.readinto(block)
            if not count:
                return digest.hexdigest()
            digest.update(view[:count])


def _incoming_prefix() -> str:
    return f".incoming-{socket.gethostname()}-"  # a store on a shared home is shared by several machines


def _sweep_incoming(store: str) -> None:
    """Folders of this machine's earlier receives whose runctl is gone (killed with its SSH session)."""
    for name in os.listdir(store):
        pid = name[len(_incoming_prefix()):]
        if name.startswith(_incoming_prefix()) and not (pid.isdigit() and os.path.exists(f"/proc/{pid}")):
            shutil.rmtree(os.path.join(store, name), ignore_errors=True)


def _commit(store: str, incoming: str, names: list) -> tuple:
    """Objects unpacked in `incoming` enter the store only once their content hashes to their name."""
    count, size = 0, 0
    for name in names:
        path = os.path.join(incoming, name)
        if not os.path.isfile(path) or os.path.islink(path) or "/" in name or name.startswith("."):
            raise ValueError(f"unexpected entry {name!r} in the upload")
        if _hash_file(path) != name:
            return count, size, name
        os.chmod(path, 0o600)
        os.utime(path, (STORE_MTIME, STORE_MTIME))
        size += os.path.getsize(path)
        os.replace(path, os.path.join(store, name))
        count += 1
    return count, size, None


def _tar_records(tar: str) -> list:
    """GNU tar reads and writes 10 KiB records by default: 20,000 system calls each way for 200 MiB, most of
    its CPU. 256 KiB records, read whole from the pipe (-B), take half of it. Other tars keep their defaults."""
    try:
        version = subprocess.run([tar, "--version"], capture_output=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return ["-b", "512", "-B"] if b"GNU tar" in version else []


def _widen_pipe(fd: int) -> None:
    """sshd hands the stream over a pipe of 64 KiB; a wider one (Linux) lets it write ahead of tar."""
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    except (ImportError, OSError):
        pass  # not a pipe, or not Linux: the default width works, only slower


def _receive_with_tar(tar: str, store: str, incoming: str) -> dict:
    """The node's own tar unpacks the stream (C: one pass, the bytes never cross Python), then each object is
    hash-checked and moved into the store. A stream cut midway makes tar fail: nothing of it is kept."""
    argv = [tar, "-x", "--no-same-owner", "--no-same-permissions", *_tar_records(tar), "-C", incoming, "-f", "-"]
    try:
        source = sys.stdin.buffer.fileno()
    except (AttributeError, OSError, ValueError):  # not a file descriptor: fed through a pipe
        source = None
    else:
        _widen_pipe(source)
    with subprocess.Popen(argv, stdin=subprocess.PIPE if source is None else source, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE) as proc:
        if source is None:
            shutil.copyfileobj(sys.stdin.buffer, proc.stdin, STREAM_BUFFER)
            proc.stdin.close()
        errors = proc.stderr.read()
    if proc.returncode != 0:
        raise ValueError(f"the upload did not arrive whole: {errors.decode(errors='replace').strip()[-300:]}")
    count, size, corrupted = _commit(store, incoming, sorted(os.listdir(incoming)))
    if corrupted:
        return {"error": f"object {corrupted} arrived corrupted", "corrupted": corrupted}
    return {"received": count, "bytes": size}


def _receive_with_tarfile(store: str) -> dict:
    """Where the node has no tar: Python's tarfile, one object at a time."""
    count, size = 0, 0
    with tarfile.open(fileobj=sys.stdin.buffer, mode="r|", bufsize=STREAM_BUFFER) as tar:
        for member in tar:
            if not member.isfile() or "/" in member.name or member.name.startswith("."):
                raise ValueError(f"unexpected entry {member.name!r} in the upload")
            sha, tmp = _private_copy(tar.extractfile(member), os.path.join(store, member.name))
            if sha != member.name:
                os.unlink(tmp)
                return {"error": f"object {member.name} arrived corrupted", "corrupted": member.name}
            os.utime(tmp, (STORE_MTIME, STORE_MTIME))
            os.replace(tmp, os.path.join(store, member.name))
            count, size = count + 1, size + member.size
    return {"received": count, "bytes": size}


def cmd_receive(args: list, request: dict) -> dict:
    """Objects for the content-addressed store, as a tar stream on stdin (nothing of it is kept but the
    objects: no upload file that a broken connection could leave behind). Each object lands under a temporary
    name and is renamed only once its content hashes to its name; a truncated stream leaves nothing. With a
    `prepare` request, the run folder is laid out once every object is in (one call instead of two)."""
    store = os.path.join(os.path.expanduser(args[0]), ".nodectl", "objects")
    os.makedirs(store, mode=0o700, exist_ok=True)
    os.chmod(store, 0o700)
    _sweep_incoming(store)
    tar = shutil.which("tar")
    if not tar or os.environ.get("NODECTL_NO_TAR"):
        answer = _receive_with_tarfile(store)
    else:
        incoming = os.path.join(store, f"{_incoming_prefix()}{os.getpid()}")
        os.mkdir(incoming, 0o700)
        try:
            answer = _receive_with_tar(tar, store, incoming)
        finally:
            shutil.rmtree(incoming, ignore_errors=True)
    if request.get("prepare") and not answer.get("error"):  # the run folder, in the same call
        answer.update(cmd_prepare([], request["prepare"]))
    return answer


def _place(source: str, target: str, mode: int) -> None:
    """Put a store object at `target`: a hard link where the modes agree (the store's objects are 0600), else (a
    program, or a file system that refuses links) a private in-kernel copy. The store was hash-checked."""
    tmp = f"{target}.{os.getpid()}.tmp"
    if mode == 0o600:
        try:
            os.link(source, tmp)
            os.replace(tmp, target)
            return
        except OSError:
            if os.path.lexists(tmp):
                os.unlink(tmp)
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode))  # private before any byte lands
    shutil.copyfile(source, tmp)
    os.chmod(tmp, mode)
    os.replace(tmp, target)


def cmd_prepare(args: list, request: dict) -> dict:
    """Lay out the run folder: code and lib from the object store, the rendered files, the state folders."""
    workdir, run_dir = os.path.expanduser(request["workdir"]), os.path.expanduser(request["run_dir"])
    store = os.path.join(workdir, ".nodectl", "objects")
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    os.chmod(run_dir, 0o700)
    if request.get("new_attempt"):
        _archive_attempt(run_dir)
    for name in STATE_DIRS:
        os.makedirs(os.path.join(run_dir, name), exist_ok=True)
    real_run_dir = os.path.realpath(run_dir)  # the workdir may be reached through a symlink
    for entry in request["files"]:
        target = os.path.join(run_dir, entry["path"])
        if os.path.commonpath([real_run_dir, os.path.realpath(target)]) != real_run_dir:
            raise ValueError(f"path {entry['path']!r} leaves the run folder")
        os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
        mode = 0o700 if entry.get("mode", 0) & 0o111 else 0o600
        _place(os.path.join(store, entry["sha256"]), target, mode)
    for name, spec in request["rendered"].items():
        _write(os.path.join(run_dir, name), spec["text"], spec["mode"])
    synced = sorted(e["path"][len("code/"):] for e in request["files"] if e["path"].startswith("code/"))
    _write(os.path.join(run_dir, SYNCED_CODE), json.dumps(synced), 0o600)
    return {"run_dir": run_dir, "files": len(request["files"])}


SYNCED_CODE = "lib/synced-code.json"   # what `prepare` put in code/: what `pack` leaves there (the user's project)


ATTEMPT_DIRS = ("logs", "state", "heartbeat", "stacks", "flight", "timing")


def _archive_attempt(run_dir: str) -> None:
    """A resumed run keeps its folder (and output/ with the checkpoints); the last attempt's logs and state move
    to attempts/<n>/. Refused while any process of the run still lives."""
    if run_processes(run_dir):
        raise RuntimeError("the run is still running here; `nodectl stop --run RUN` first")
    if not os.path.exists(os.path.join(run_dir, "state", "pgid")):
        return
    number = len(os.listdir(os.path.join(run_dir, "attempts"))) if os.path.isdir(os.path.join(run_dir, "attempts")) else 0
    target = os.path.join(run_dir, "attempts", str(number))
    os.makedirs(target)
    for name in ATTEMPT_DIRS:
        if os.path.exists(os.path.join(run_dir, name)):
            os.replace(os.path.join(run_dir, name), os.path.join(target, name))


def cmd_port(args: list, request: dict) -> dict:
    """Whether a TCP port is free here, and a free one if not."""
    port = int(args[0])
    if port == 0:
        with socket.socket() as probe:
            probe.bind(("", 0))
            return {"port": probe.getsockname()[1], "free": True, "asked": 0}
    with socket.socket() as probe:
        # torch's TCPStore binds with SO_REUSEADDR, so sockets in TIME_WAIT from a run or a reachability test that
        # just ended do not stop it; judge the port the same way.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
            return {"port": port, "free": True, "asked": port}
        except OSError:
            pass
    with socket.socket() as probe:
        probe.bind(("", 0))
        return {"port": probe.getsockname()[1], "free": False, "asked": port}


def cmd_start(args: list, request: dict) -> dict:
    """Start launch.sh detached in its own session; it survives the SSH connection that started it."""
    run_dir = os.path.expanduser(args[0])
    node = _read_json(os.path.join(run_dir, "node.json"))
    if os.path.exists(os.path.join(run_dir, "state", "pgid")):
        return {"error": f"{run_dir} was already started"}
    env = dict(os.environ, NODECTL_RUN_ID=node["run_id"], NODECTL_NODE_RANK=str(node["node_rank"]))
    group = _new_run_group(f"{node['run_id']}-{node['node_rank']}")

    def enter() -> None:
        _become_subreaper()
        if group:
            _join_group(group)

    with open(os.path.join(run_dir, "logs", "launcher.log"), "ab") as log:
        proc = subprocess.Popen(["/bin/bash", os.path.join(run_dir, "launch.sh")], cwd=run_dir, env=env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=enter)
    tracked = bool(group) and _in_group(proc.pid, group)
    if tracked:
        _write(os.path.join(run_dir, "state", "cgroup"), json.dumps(group), 0o600)
    else:
        _remove_group(group)
    _write(os.path.join(run_dir, "state", "pgid"), str(proc.pid))
    _write(os.path.join(run_dir, "state", "started"), str(time.time()))
    return {"pgid": proc.pid, "tracked_by": "cgroup" if tracked else "subreaper"}


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


def _new_run_group(name: str):
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


def _join_group(group: dict) -> None:
    """In launch.sh's process before it runs: enter the run's group (a failure leaves the subreaper alone)."""
    try:
        with open(os.path.join(group["dir"], "cgroup.procs"), "w", encoding="utf-8") as handle:
            handle.write("0")
    except OSError:
        pass


def _in_group(pid: int, group: dict) -> bool:
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


def _group_of(run_dir: str):
    """The run's cgroup as start recorded it, only when it is one runctl makes: <mount>/nodectl/<run id>-<node
    rank> of a hierarchy mounted here, its path that group's own (never empty: "" would match every process)."""
    group = _read_json(os.path.join(run_dir, "state", "cgroup"))
    node = _read_json(os.path.join(run_dir, "node.json"))
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


def _remove_group(group) -> None:
    if group:
        try:
            os.rmdir(group["dir"])
        except OSError:
            pass


def _become_subreaper() -> None:
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
        with open(os.path.join(run_dir, "state", "pgid"), encoding="utf-8") as handle:
            pid = int(handle.read())
    except (OSError, ValueError):
        return None
    return pid if belongs(pid, markers) and not _is_zombie(pid) else None


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


def _markers(run_dir: str) -> tuple:
    node = _read_json(os.path.join(run_dir, "node.json"), {})
    return (f"NODECTL_RUN_ID={node.get('run_id')}".encode(), f"NODECTL_NODE_RANK={node.get('node_rank')}".encode())


def belongs(pid: int, markers: tuple) -> bool:
    """Proof that a pid is a process of this run on this node: its environment carries the run id and node rank
    (runctl starts launch.sh with them and every process of the run inherits them). A recorded pid or process
    group alone proves nothing: after a reboot or a wrap-around the number may name someone else's process."""
    environ = _proc_environ(pid).split(b"\0")
    return all(marker in environ for marker in markers)


def run_processes(run_dir: str) -> list:
    """Live pids of this node's share of the run (never this helper itself): those whose environment carries
    the run's markers, every descendant of its launch.sh (a subreaper: see _become_subreaper), and every member
    of the run's cgroup where it has one (_new_run_group)."""
    markers = _markers(run_dir)
    parents = _parents()
    launcher = _launcher(run_dir, markers)
    tree = _descendants(launcher, parents) | {launcher} if launcher else set()
    tree |= _group_members(_group_of(run_dir))
    pids = [pid for pid in parents if pid != os.getpid()]
    return [pid for pid in pids if (pid in tree or belongs(pid, markers)) and not _is_zombie(pid)]


def _ours(pid: int, markers: tuple, run_dir) -> bool:
    if belongs(pid, markers):
        return True
    group = _group_of(run_dir) if run_dir else None
    if group and _in_group(pid, group):
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


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _rank_state(run_dir: str, rank: int, now: float, markers: tuple) -> dict:
    state = {"rank": rank, "exit": _read_json(os.path.join(run_dir, "state", f"rank{rank}.exit"))}
    try:
        with open(os.path.join(run_dir, "state", f"rank{rank}.pid"), encoding="utf-8") as handle:
            pid = int(handle.read())
        state["pid"], state["alive"] = pid, belongs(pid, markers) and not _is_zombie(pid)
    except (OSError, ValueError):
        state["pid"], state["alive"] = None, False
    heartbeat = _read_json(os.path.join(run_dir, "heartbeat", f"rank{rank}.json"))
    if isinstance(heartbeat, dict):
        state["heartbeat"] = heartbeat
        state["heartbeat_age"] = round(now - float(heartbeat.get("time", now)), 1)
    log = os.path.join(run_dir, "logs", f"rank{rank}.log")
    state["log_size"] = os.path.getsize(log) if os.path.exists(log) else 0
    return state


LINE_MAX = 16 * 1024


def _read_from(path: str, offset: int) -> tuple:
    """(new offset, text) of a log from `offset`: whole lines, up to READ_LIMIT bytes, or what there is at the
    end of the file. A line longer than READ_LIMIT is never waited for (that stalled the stream for good): it is
    shortened to LINE_MAX characters with a marker, keeping its latest \\r state (a progress bar), else its start."""
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read(READ_LIMIT)
            if len(data) < READ_LIMIT:
                return offset + len(data), data.decode("utf-8", errors="replace")
            cut = data.rfind(b"\n") + 1
            if cut:
                return offset + cut, data[:cut].decode("utf-8", errors="replace")
            end = _next_newline(handle, offset + len(data))
            stop = end if end is not None else os.fstat(handle.fileno()).st_size
            handle.seek(max(offset, stop - LINE_MAX))
            tail = handle.read(stop - max(offset, stop - LINE_MAX))
    except OSError:
        return offset, ""
    if b"\r" in tail:
        kept = tail.rsplit(b"\r", 1)[-1]  # a progress bar: its latest state
    elif b"\r" in data:
        kept = tail
    else:
        kept = data[:LINE_MAX]
    marker = f" [line cut by nodectl: {stop - offset} bytes]"
    text = kept[:LINE_MAX].decode("utf-8", errors="replace") + marker
    return (end + 1, text + "\n") if end is not None else (stop, text)


def _next_newline(handle, position: int):
    """The offset of the next newline at or after `position`, or None at the end of the file."""
    handle.seek(position)
    while True:
        block = handle.read(1 << 20)
        if not block:
            return None
        found = block.find(b"\n")
        if found >= 0:
            return position + found
        position += len(block)


GPU_FIELDS = ("index", "utilization.gpu", "memory.used", "memory.total", "temperature.gpu", "power.draw")
GPU_KEYS = ("index", "util", "mem_used_mib", "mem_total_mib", "temp_c", "power_w")


def gpu_sample() -> dict:
    """Every GPU of the node through nvidia-smi (part of every driver install): {"gpus": [...]} or {"error": ...}."""
    try:
        proc = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(GPU_FIELDS)}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10)
    except FileNotFoundError:
        return {"error": "nvidia-smi not found (no NVIDIA driver on this node)"}
    except subprocess.TimeoutExpired:
        return {"error": "nvidia-smi did not answer within 10 s"}
    if proc.returncode != 0:
        return {"error": f"nvidia-smi failed: {(proc.stderr or proc.stdout).strip()[:200]}"}
    gpus = []
    for line in proc.stdout.splitlines():
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) != len(GPU_KEYS):
            continue
        row = {}
        for key, cell in zip(GPU_KEYS, cells):
            try:
                row[key] = int(cell) if key == "index" else float(cell)
            except ValueError:  # [N/A], [Not Supported]
                row[key] = None
        gpus.append(row)
    return {"gpus": gpus}


def cmd_poll(args: list, request: dict) -> dict:
    """The node's state for one run, plus new log text for the ranks asked for (from their offsets)."""
    run_dir, now = os.path.expanduser(args[0]), time.time()
    node = _read_json(os.path.join(run_dir, "node.json"))
    if node is None:
        return {"error": f"no run at {run_dir}"}
    pids = run_processes(run_dir)
    answer = {"now": now, "node_rank": node["node_rank"], "alive": len(pids),
              "launcher_exit": _read_json(os.path.join(run_dir, "state", "launcher.exit")),
              "started": os.path.exists(os.path.join(run_dir, "state", "pgid")),
              "stopped": os.path.exists(os.path.join(run_dir, "state", "stopped")),
              "ranks": [_rank_state(run_dir, rank, now, _markers(run_dir)) for rank in node["ranks"]], "logs": {}}
    for rank, offset in (request.get("offsets") or {}).items():
        new_offset, text = _read_from(os.path.join(run_dir, "logs", f"rank{rank}.log"), int(offset))
        answer["logs"][rank] = {"from": int(offset), "offset": new_offset, "text": text}
    if request.get("gpus"):
        answer["gpu_sample"] = gpu_sample()
    upload = _read_json(os.path.join(run_dir, "state", "upload.json"))
    if isinstance(upload, dict):
        answer["upload"] = _upload_state(upload, now, _markers(run_dir))
    return answer


def _upload_state(upload: dict, now: float, markers: tuple) -> dict:
    """The uploader's own record, with the one thing it cannot say itself: that it is gone before its last round
    (killed, or the node ran out of memory). Its pid counts only while that process is still this run's."""
    pid = upload.get("pid")
    if upload.get("final") or not isinstance(pid, int) or isinstance(pid, bool):
        return upload
    if belongs(pid, markers) and not _is_zombie(pid):
        return upload
    return dict(upload, error=f"the uploader (pid {pid}) ended before its last round (killed?): what it had not "
                              f"sent is not in the bucket, and nothing half-sent is taken; `launch --resume` starts "
                              f"a new one", error_time=upload.get("error_time") or now)


def cmd_tail(args: list, request: dict) -> dict:
    """The last `lines` lines of each rank's log, with the offset a follower continues from."""
    run_dir = os.path.expanduser(args[0])
    lines, out = int(request.get("lines", 20)), {}
    for rank in request["ranks"]:   # "launcher": torchrun's own log (launch.sh's output)
        name = "launcher.log" if rank == "launcher" else f"rank{int(rank)}.log"
        path = os.path.join(run_dir, "logs", name)
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as handle:
                handle.seek(max(0, size - 64 * 1024 * max(1, lines // 100 + 1)))
                text = handle.read().decode("utf-8", errors="replace")
        except OSError:
            size, text = 0, ""
        kept = text.splitlines()[-lines:] if lines > 0 else []
        out[str(rank)] = {"offset": size, "text": "\n".join(kept) + ("\n" if kept else "")}
    return {"logs": out}


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
    markers = _markers(run_dir)
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
        _remove_group(_group_of(run_dir))
    removed = remove_container(run_dir)
    if removed:
        stopped["container"] = removed
    if targets:
        _write(os.path.join(run_dir, "state", "stopped"), json.dumps(stopped))
    return dict(stopped, left=len(run_processes(run_dir)))


def _quiet(argv: list, timeout: float, stdin: str | None = None) -> tuple:
    """(exit code, stdout, stderr) of a command run without a shell; 127 when it is missing, 124 on timeout."""
    try:
        proc = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        return 127, "", f"{argv[0]}: not found"
    except subprocess.TimeoutExpired:
        return 124, "", f"{' '.join(argv[:3])} did not answer within {timeout:.0f} s"
    return proc.returncode, proc.stdout, proc.stderr


def _last_json(text: str):
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except (ValueError, RecursionError):
                continue
    return None


def cmd_container(args: list, request: dict) -> dict:
    """The node's container runtime, checked as the ranks will use it: installed, usable by this user, its version,
    the image present (docker and podman pull it when missing), and with a `probe` request, launchers/probe.py's
    report from inside the image."""
    runtime, image = request["runtime"], request["image"]
    if not shutil.which(runtime):
        return {"installed": False}
    answer = {"installed": True}
    if runtime in ("docker", "podman"):
        code, out, err = _quiet([runtime, "version", "--format", "{{.Client.Version}}"], 30)
        answer["version"] = out.strip() or err.strip()[-300:]
        usable = "{{.Host.OCIRuntime.Name}}" if runtime == "podman" else "{{.ServerVersion}}"
        code, out, err = _quiet([runtime, "info", "--format", usable], 60)
        answer["usable"], answer["usable_output"] = code == 0, (err or out).strip()[-600:]
        if code == 0:
            inspect = [runtime, "image", "inspect", "--format", "{{.Id}}", image]
            code, out, err = _quiet(inspect, 60)
            if code != 0 and request.get("pull"):
                pulled, pout, perr = _quiet([runtime, "pull", image], 3600)
                answer["pulled"], answer["pull_output"] = pulled == 0, (perr or pout).strip()[-600:]
                if pulled == 0:
                    code, out, err = _quiet(inspect, 60)
            answer["image_present"] = code == 0
            answer["image_id"] = out.strip() if code == 0 else None
    else:  # apptainer, enroot: the image is a file on the node (or, for apptainer, a URI it pulls at start)
        code, out, err = _quiet([runtime, "--version"] if runtime == "apptainer" else [runtime, "version"], 30)
        answer["version"], answer["usable"] = (out or err).strip()[-300:], code == 0
        path = os.path.expanduser(image)
        answer["image_present"] = os.path.isfile(path) if "://" not in image else None
        if answer["image_present"]:
            stat_of = os.stat(path)
            answer["image_id"] = f"{stat_of.st_size}-{int(stat_of.st_mtime)}"
    probe = request.get("probe")
    if probe and answer.get("usable") and answer.get("image_present") is not False:
        argv = list(probe["argv"])
        if runtime in ("docker", "podman"):  # the limits launch.sh gives the ranks: the node's hard limits
            argv[2:2] = [word for kind, name in ((resource.RLIMIT_MEMLOCK, "memlock"), (resource.RLIMIT_NOFILE, "nofile"))
                         for word in ("--ulimit", "{0}={1}:{1}".format(name, _hard_limit(kind)))]
        code, out, err = _quiet(argv, 240, stdin=probe["source"])
        report = _last_json(out)
        answer["probe"] = report if isinstance(report, dict) else \
            {"error": f"the probe in the image exited {code}: {(err or out).strip()[-600:]}"}
    return answer


def _hard_limit(kind: int) -> int:
    hard = resource.getrlimit(kind)[1]
    return -1 if hard == resource.RLIM_INFINITY else hard


def remove_container(run_dir: str) -> dict:
    """The run's container on this node (named in node.json), removed with whatever still runs in it; what the
    runtime said, or {} when the run has none."""
    container = (_read_json(os.path.join(run_dir, "node.json"), {}) or {}).get("container")
    if not container or container.get("runtime") not in ("docker", "podman", "enroot"):
        return {}
    runtime, name = container["runtime"], container["name"]
    argv = [runtime, "rm", "-f", name] if runtime != "enroot" else [runtime, "remove", "-f", name]
    code, out, err = _quiet(argv, 60)
    gone = code == 0 or "no such container" in (err + out).lower() or "no container with" in (err + out).lower()
    return {"container": name, "removed": gone, **({} if gone else {"error": (err or out).strip()[-300:]})}


# Locked environments (hosts.yaml `environment:`, nodectl/environment.py): one venv per node per lock, built from
# wheels the controller fetched and sent through the object store, under <workdir>/.nodectl/envs/<key>/, where the
# key is the lock's hash with this interpreter's version and platform. Its manifest (every file's size and mtime,
# bytecode caches aside) is what later launches compare against: a changed, added or removed file is drift.
ENV_INFO, ENV_MANIFEST = "nodectl-env.json", "nodectl-manifest.json"


def _platform() -> dict:
    import platform

    libc, version = platform.libc_ver()
    return {"python": "{}.{}".format(*sys.version_info[:2]), "implementation": sys.implementation.name,
            "machine": platform.machine(), "libc": libc or "", "libc_version": version or "",
            "executable": sys.executable}


def _env_key(lock_sha: str, facts: dict) -> str:
    ident = "|".join([lock_sha, facts["implementation"], facts["python"], facts["machine"], facts["libc"],
                      facts["libc_version"]])
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _env_files(env_dir: str) -> dict:
    """relative path -> [size, mtime_ns] of every file and link of a venv, bytecode caches aside (Python writes
    them on first import) and nodectl's own two files aside."""
    found = {}
    for folder, dirs, names in os.walk(env_dir):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in names:
            if name.endswith(".pyc") or folder == env_dir and name in (ENV_INFO, ENV_MANIFEST):
                continue
            path = os.path.join(folder, name)
            info = os.lstat(path)
            found[os.path.relpath(path, env_dir)] = [info.st_size, info.st_mtime_ns]
    return found


def _env_state(env_dir: str) -> dict:
    info = _read_json(os.path.join(env_dir, ENV_INFO))
    if not isinstance(info, dict):
        return {"present": False}
    built = _read_json(os.path.join(env_dir, ENV_MANIFEST), {}) or {}
    now = _env_files(env_dir)
    changed = sorted(p for p in built if p in now and now[p] != built[p])
    added, removed = sorted(set(now) - set(built)), sorted(set(built) - set(now))
    return {"present": True, "intact": not (changed or added or removed), "built": info.get("built"),
            "packages": info.get("packages"), "installer": info.get("installer"), "seconds": info.get("seconds"),
            "changed": changed[:5], "added": added[:5], "removed": removed[:5],
            "drift": len(changed) + len(added) + len(removed)}


def cmd_env_status(args: list, request: dict) -> dict:
    """This node's interpreter and platform, the key of the lock's venv here, and that venv's state."""
    facts = _platform()
    key = _env_key(request["lock_sha"], facts)
    env_dir = os.path.join(os.path.expanduser(args[0]), ".nodectl", "envs", key)
    return dict(facts, key=key, path=env_dir, python_path=os.path.join(env_dir, "bin", "python"),
                **_env_state(env_dir))


def _uv_cache(workdir: str) -> str:
    return os.path.join(workdir, ".nodectl", "uv-cache")


def _uv_binary(workdir: str, store: str, wheel: dict) -> str:
    """uv's executable, taken once from its wheel (a zip; the controller sent it for this platform)."""
    import zipfile

    tools = os.path.join(workdir, ".nodectl", "tools")
    target = os.path.join(tools, "uv-" + wheel["sha256"][:16])
    if os.path.isfile(target):
        return target
    os.makedirs(tools, mode=0o700, exist_ok=True)
    with zipfile.ZipFile(os.path.join(store, wheel["sha256"])) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".data/scripts/uv"))
        tmp = f"{target}.{os.getpid()}.tmp"
        with archive.open(name) as source, open(tmp, "wb") as sink:
            shutil.copyfileobj(source, sink, STREAM_BUFFER)
    os.chmod(tmp, 0o700)
    os.replace(tmp, target)
    return target


def cmd_env_build(args: list, request: dict) -> dict:
    """The lock's venv on this node: reused when present and unchanged; else (re)built from the wheels in the
    object store with uv (sent by the controller) or the interpreter's own venv and pip, offline. `index` installs
    from the node's own package index instead. One build at a time per key (a lock file), in place (a venv is not
    relocatable) with its info file written last, so a build cut midway is never taken for a finished one."""
    import fcntl

    workdir = os.path.expanduser(args[0])
    facts = _platform()
    key = _env_key(request["lock_sha"], facts)
    envs = os.path.join(workdir, ".nodectl", "envs")
    env_dir = os.path.join(envs, key)
    os.makedirs(envs, mode=0o700, exist_ok=True)
    with open(os.path.join(envs, key + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = _env_state(env_dir)
        if state.get("present") and state.get("intact"):
            return dict(facts, **state, key=key, python_path=os.path.join(env_dir, "bin", "python"), reused=True)
        replaced = None
        if state.get("present"):   # drifted: kept aside for a look (the last one only), never used again
            replaced = f"{env_dir}.drifted"
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(env_dir, replaced)
            shutil.rmtree(_uv_cache(workdir), ignore_errors=True)   # it may hold the changed bytes (hard links)
        shutil.rmtree(env_dir, ignore_errors=True)   # a build cut midway (no info file)
        started = time.time()
        try:
            installer, packages = _build_env(workdir, env_dir, request)
        except Exception:
            shutil.rmtree(env_dir, ignore_errors=True)
            raise
        seconds = round(time.time() - started, 2)
        _write(os.path.join(env_dir, ENV_MANIFEST), json.dumps(_env_files(env_dir)))
        _write(os.path.join(env_dir, ENV_INFO), json.dumps({"key": key, "lock_sha": request["lock_sha"],
                                                            "built": time.time(), "installer": installer,
                                                            "packages": packages, "seconds": seconds, **facts}))
    return dict(facts, **_env_state(env_dir), key=key, python_path=os.path.join(env_dir, "bin", "python"),
                reused=False, replaced=replaced)


def _build_env(workdir: str, env_dir: str, request: dict) -> tuple:
    store = os.path.join(workdir, ".nodectl", "objects")
    python = os.path.join(env_dir, "bin", "python")
    wheels = request.get("wheels") or []
    folder = os.path.join(workdir, ".nodectl", "wheels")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    paths = []
    for wheel in wheels:   # the store names objects by hash; installers need the wheel's file name
        path = os.path.join(folder, wheel["name"])
        if not (os.path.exists(path) and os.path.samefile(path, os.path.join(store, wheel["sha256"]))):
            _place(os.path.join(store, wheel["sha256"]), path, 0o600)
        paths.append(path)
    uv = _uv_binary(workdir, store, request["uv"]) if request.get("uv") else None
    # uv unpacks each wheel once into its cache on the node and hard-links the venv's files from there: a venv
    # for a changed lock costs the changed packages only, and no second copy of the disk. A file edited in place
    # in one venv is then edited in the cache too, so a drifted venv empties the cache first (cmd_env_build).
    env = dict(os.environ, UV_CACHE_DIR=_uv_cache(workdir), UV_LINK_MODE="hardlink", UV_NO_PROGRESS="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_CACHE_DIR="1")
    env.pop("VIRTUAL_ENV", None)
    if request.get("index"):
        if request["index"] != "default":   # in pip's environment, never its argv (`ps` shows argv to every user)
            env["PIP_INDEX_URL"] = request["index"]
        requirements = os.path.join(folder, "requirements-" + request["lock_sha"][:16] + ".txt")
        _write(requirements, request["requirements"], 0o600)
        steps = [[sys.executable, "-m", "venv", env_dir],
                 [python, "-m", "pip", "install", "-q",
                  "-r", requirements]]
        installer = "pip (node's index)"
    elif uv:
        steps = [[uv, "venv", "-q", "--python", sys.executable, env_dir],
                 [uv, "pip", "install", "-q", "--python", python, "--offline", "--no-index", "--no-deps", *paths]]
        installer = "uv"
    else:
        steps = [[sys.executable, "-m", "venv", env_dir],
                 [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", *paths]]
        installer = "pip"
    for argv in steps:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise RuntimeError(f"{os.path.basename(argv[0])} {argv[1]} failed ({proc.returncode}): "
                               f"{(proc.stderr or proc.stdout).strip()[-800:]}")
    return installer, len(wheels) or None


def cmd_stacks(args: list, request: dict) -> dict:
    """Every rank's Python stack: py-spy where installed, else SIGUSR1 to programs that registered for it."""
    run_dir = os.path.expanduser(args[0])
    node = _read_json(os.path.join(run_dir, "node.json"), {})
    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    stacks = {}
    for rank in node.get("ranks", []):
        state = _rank_state(run_dir, rank, time.time(), _markers(run_dir))
        if not state["alive"]:
            stacks[str(rank)] = {"error": "not running"}
            continue
        stacks[str(rank)] = _stack_of(run_dir, rank, state["pid"], py_spy)
    return {"stacks": stacks, "tool": "py-spy" if py_spy else "faulthandler"}


def _stack_of(run_dir: str, rank: int, pid: int, py_spy) -> dict:
    if py_spy:
        proc = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
        if proc.returncode == 0:
            return {"text": proc.stdout}
    ready = os.path.join(run_dir, "stacks", f"rank{rank}.ready")
    if not os.path.exists(ready):
        text = _listener_stack(run_dir, rank)
        if text:
            return {"text": text}
        return {"error": "py-spy is not installed on the node, the program registered no SIGUSR1 handler and its "
                         "listener did not answer (a program run with -S or -I has none; `pip install py-spy` "
                         "covers any program)"}
    path = os.path.join(run_dir, "stacks", f"rank{rank}.txt")
    before = os.path.getsize(path) if os.path.exists(path) else 0
    if not signal_run_process(pid, signal.SIGUSR1, _markers(run_dir)):
        return {"error": "the rank ended before its stack could be taken"}
    for _ in range(50):
        time.sleep(0.1)
        if os.path.exists(path) and os.path.getsize(path) > before:
            time.sleep(0.2)  # let faulthandler finish every thread
            break
    with open(path, "rb") as handle:
        handle.seek(before)
        return {"text": handle.read().decode("utf-8", errors="replace")}


def _listener_stack(run_dir: str, rank: int, wait: float = 5.0) -> str:
    """Every thread's stack from the rank's own listener (lib/sitecustomize.py), as text; "" without an answer."""
    flight, request_id = os.path.join(run_dir, "flight"), f"stacks-{time.time_ns()}-{os.getpid()}"
    deadline = time.monotonic() + wait
    if not _ask_listener(os.path.join(flight, f"rank{rank}.request"), request_id, time.monotonic() + 1.0):
        return ""
    while time.monotonic() < deadline:
        answer = _read_json(os.path.join(flight, f"rank{rank}.answer.json"))
        if isinstance(answer, dict) and answer.get("request") == request_id and answer.get("threads"):
            lines = [f"Process {answer.get('pid')} (rank {rank}; from its listener)"]
            for thread in answer["threads"]:
                lines.append(f"Thread {thread.get('native_id')} ({thread.get('name')})"
                             f"{' [main]' if thread.get('main') else ''}")
                for filename, lineno, function, code in reversed(thread.get("frames") or []):
                    lines.append(f"    {function} ({filename}:{lineno})" + (f"\n        {code}" if code else ""))
            return "\n".join(lines) + "\n"
        time.sleep(0.05)
    return ""


def _cpu_ticks(pid: int) -> dict:
    """{thread id: (state letter, user + system clock ticks)} of a process's threads; {} when it is gone."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="utf-8") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            out[int(tid)] = (fields[0], int(fields[11]) + int(fields[12]))
        except (OSError, IndexError, ValueError):
            continue
    return out


def _cpu_use(before: dict, after: dict, seconds: float, skip=None) -> dict:
    """The process's CPU use between two samples, in % of one core, with its busiest threads (not counting
    `skip`, the listener answering the request)."""
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    per_thread = {tid: round(100.0 * (after[tid][1] - before.get(tid, (None, after[tid][1]))[1]) / hz / seconds, 1)
                  for tid in after if tid != skip}
    busiest = sorted(per_thread.items(), key=lambda item: -item[1])[:8]
    return {"percent": round(sum(per_thread.values()), 1), "threads": {str(t): p for t, p in busiest if p > 0},
            "seconds": round(seconds, 2)}


def _ask_listener(fifo: str, request_id: str, deadline: float) -> bool:
    """Write a request to a rank's listener (launchers/sitecustomize.py); False when none reads the FIFO (the
    program is not Python, ran with -S or -I, or ended)."""
    while True:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno == errno.ENXIO and time.monotonic() < deadline:   # between two requests: it reopens
                time.sleep(0.05)
                continue
            return False
        try:
            os.write(fd, (request_id + "\n").encode())
            return True
        except OSError:
            return False
        finally:
            os.close(fd)


def cmd_diagnose(args: list, request: dict) -> dict:
    """Everything `nodectl diagnose` judges, from every rank of this node at once: its state and heartbeat, what
    its listener answers from inside the process (every thread's stack, the flight recorder), its CPU use over
    about a second, its last log lines; py-spy or faulthandler for a rank without a listener."""
    run_dir = os.path.expanduser(args[0])
    node = _read_json(os.path.join(run_dir, "node.json"))
    if node is None:
        return {"error": f"no run at {run_dir}"}
    wait, lines = float(request.get("wait", 5.0)), int(request.get("lines", 20))
    markers, started = _markers(run_dir), time.monotonic()
    states = {rank: _rank_state(run_dir, rank, time.time(), markers) for rank in node["ranks"]}
    live = {rank: state["pid"] for rank, state in states.items() if state["alive"]}
    before = {rank: _cpu_ticks(pid) for rank, pid in live.items()}
    request_id = f"{time.time_ns()}-{os.getpid()}"
    flight = os.path.join(run_dir, "flight")
    asked = {rank for rank in live
             if _ask_listener(os.path.join(flight, f"rank{rank}.request"), request_id, started + 1.0)}
    answers, deadline = {}, started + wait
    while len(answers) < len(asked) and time.monotonic() < deadline:
        for rank in asked - set(answers):
            answer = _read_json(os.path.join(flight, f"rank{rank}.answer.json"))
            if isinstance(answer, dict) and answer.get("request") == request_id:
                answers[rank] = answer
        time.sleep(0.05)
    time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))   # CPU use over a second at least
    seconds = time.monotonic() - started
    after = {rank: _cpu_ticks(pid) for rank, pid in live.items()}
    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    tails = cmd_tail([run_dir], {"ranks": node["ranks"], "lines": lines})["logs"]
    out = {}
    for rank, state in states.items():
        entry = dict(state, log_tail=tails.get(str(rank), {}).get("text", ""))
        if rank in live:
            entry["cpu"] = _cpu_use(before[rank], after[rank], seconds, (answers.get(rank) or {}).get("listener_tid"))
            entry["main_state"] = (after[rank].get(live[rank]) or ("?",))[0]
            if rank in answers:
                entry["listener"] = answers[rank]
            else:
                entry["listener_error"] = ("its listener did not answer within {:.0f} s".format(wait)
                                           if rank in asked else "no listener in the process")
                entry["stack"] = _stack_of(run_dir, rank, live[rank], py_spy)
        out[str(rank)] = entry
    timeout_dumps = sorted(name for name in os.listdir(flight) if name.startswith("rank_")) \
        if os.path.isdir(flight) else []
    return {"now": time.time(), "node_rank": node["node_rank"], "ranks": out,
            "launcher_exit": _read_json(os.path.join(run_dir, "state", "launcher.exit")),
            "gpu_sample": gpu_sample() if shutil.which("nvidia-smi") else None, "timeout_dumps": timeout_dumps}


def cmd_pack(args: list, request: dict) -> dict:
    """A tar.gz of the run's results (not code/ or lib/, not env.sh or launch.sh, which hold the real secrets;
    the controller keeps their redacted copies) for `collect` to fetch, plus the run-relative paths in
    request["also"] (a script's `--output_dir out` lands in code/out). Files that vanish while it is packed (a
    checkpoint rotating out) are counted, not an error; what is neither a file, a folder nor a link to a sibling
    (a fifo, a socket, a device, a link out of the run) is left out and counted."""
    run_dir = os.path.expanduser(args[0])
    only = request.get("only")   # top-level folders alone (output/ for `fill`), packed without compression
    target = os.path.join(run_dir, ".collect.tar" if only else ".collect.tar.gz")
    synced = set(_read_json(os.path.join(run_dir, SYNCED_CODE), []) or [])
    # "code": what the program wrote in code/ (its relative --output_dir), brought back and named
    packed = {"count": 0, "vanished": 0, "skipped": [], "missing": [], "names": set(), "code": []}
    with tarfile.open(target, "w" if only else "w:gz") as tar:
        for folder, dirs, names in os.walk(run_dir):
            relative = os.path.relpath(folder, run_dir)
            if relative == ".":
                dirs[:] = [d for d in dirs if d != "lib" and (not only or d in only) and (d != "code" or synced)]
                names = [] if only else [n for n in names if n not in SECRET_FILES and not n.startswith(".collect")]
            elif relative == "flight":
                names = [n for n in names if not n.endswith(".request")]   # the listeners' FIFOs are nodectl's
            elif relative == "code" or relative.startswith("code/"):
                dirs[:] = [d for d in dirs if d != "__pycache__"]
                inside = relative[len("code/"):] if relative != "code" else ""
                names = [n for n in names if os.path.join(inside, n) not in synced]
                packed["code"] += [os.path.join(inside, n) for n in names]
            _pack_entries(tar, folder, relative, names, dirs, packed)
        for also in request.get("also") or []:
            _pack_also(tar, run_dir, also, packed)
    return {"archive": target, "entries": packed["count"], "vanished": packed["vanished"],
            "skipped": packed["skipped"][:50], "missing": packed["missing"], "bytes": os.path.getsize(target),
            "code_written": len(packed["code"]), "code_examples": packed["code"][:5], "code_left": len(synced)}


SECRET_FILES = ("env.sh", "launch.sh")


def _pack_also(tar, run_dir: str, also: str, packed: dict) -> None:
    """One more path inside the run folder (relative, no `..`, never the files that hold secrets)."""
    parts = [p for p in str(also).split("/") if p not in ("", ".")]
    if not parts or ".." in parts or str(also).startswith("/") or parts[-1] in SECRET_FILES:
        packed["missing"].append(f"{also} (not a path inside the run folder)")
        return
    path = os.path.join(run_dir, *parts)
    if not os.path.lexists(path):
        packed["missing"].append(f"{also} (not there)")
        return
    if os.path.isdir(path) and not os.path.islink(path):
        for folder, dirs, names in os.walk(path):
            _pack_entries(tar, folder, os.path.relpath(folder, run_dir), names, dirs, packed)
    else:
        _pack_entries(tar, os.path.dirname(path), os.path.relpath(os.path.dirname(path), run_dir),
                      [parts[-1]], [], packed)


def _pack_entries(tar, folder: str, relative: str, names: list, dirs: list, packed: dict) -> None:
    links = [d for d in dirs if os.path.islink(os.path.join(folder, d))]  # output/adapter -> adapter-<step>
    for name in sorted(names + links):
        path = os.path.join(folder, name)
        arcname = os.path.normpath(os.path.join(relative, name))
        if arcname in packed["names"]:   # a --path entry that the walk packed already
            continue
        packed["names"].add(arcname)
        try:
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode) and not _sibling_link(os.readlink(path)):
                packed["skipped"].append(arcname)
                continue
            if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
                packed["skipped"].append(arcname)
                continue
            tar.add(path, arcname=arcname, recursive=False)
            packed["count"] += 1
        except FileNotFoundError:
            packed["vanished"] += 1


def cmd_fill(args: list, request: dict) -> dict:
    """Add to the run's output/ what a tar stream on stdin (another node's output/, from `pack` with `only`) holds
    and this node lacks, before a resumed attempt starts: a third-party trainer's checkpoint that global rank 0
    alone wrote (transformers writes the weights on rank 0 only) becomes whole on every node, while each node
    keeps what it wrote itself (its ranks' rng states). Nothing here is replaced; only regular files, folders and
    links to a sibling name are taken; every name stays inside output/ and nothing is written through a link; a
    file lands under a temporary name and is renamed once whole, so a cut stream leaves no partial file."""
    output = os.path.join(os.path.expanduser(args[0]), "output")
    done = {"added": 0, "bytes": 0, "kept": 0, "refused": []}
    with tarfile.open(fileobj=sys.stdin.buffer, mode="r|", bufsize=STREAM_BUFFER) as tar:
        for member in tar:
            parts = [p for p in member.name.split("/") if p not in ("", ".")]
            if member.name.startswith("/") or ".." in parts or parts[:1] != ["output"]:
                done["refused"].append(member.name[:200])
                continue
            if len(parts) == 1:
                continue
            try:
                target = os.path.join(_folder_inside(output, parts[1:-1]), parts[-1])
            except ValueError:
                done["refused"].append(member.name[:200])
                continue
            if os.path.lexists(target):
                done["kept"] += not member.isdir()
            elif member.isdir():
                os.mkdir(target, 0o700)
            elif member.issym() and _sibling_link(member.linkname):
                os.symlink(member.linkname, target)
            elif member.isfile():
                _fill_file(tar.extractfile(member), target)
                done["added"], done["bytes"] = done["added"] + 1, done["bytes"] + member.size
            else:
                done["refused"].append(member.name[:200])
    done["refused"] = done["refused"][:50]
    return done


def _folder_inside(base: str, parts: list) -> str:
    """base/parts..., each folder created (0700) where missing; ValueError where one is a link or not a folder."""
    path = base
    for part in parts:
        path = os.path.join(path, part)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            os.mkdir(path, 0o700)
            continue
        if not stat.S_ISDIR(mode):
            raise ValueError(f"{path} is not a folder")
    return path


def _fill_file(source, target: str) -> None:
    tmp = f"{target}.fill{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            shutil.copyfileobj(source, handle, STREAM_BUFFER)
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise


def _sibling_link(target: str) -> bool:
    """A link the controller can keep: to a name in the same folder (adapter -> adapter-100), not out of it."""
    return bool(target) and "/" not in target and target not in (".", "..")


def cmd_identity(args: list, request: dict) -> dict:
    """A token naming this workdir's storage: two nodes that answer the same token share the folder (an NFS
    home), so their run folders must differ. Created once, atomically (link() fails if another node won).
    Given content hashes, it also answers `have` (one call less per node)."""
    workdir = os.path.expanduser(args[0])
    folder = os.path.join(workdir, ".nodectl")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    path = os.path.join(folder, "identity")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.{socket.gethostname()}"
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(hashlib.sha256(os.urandom(32)).hexdigest()[:16])
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    with open(path, encoding="utf-8") as handle:
        answer = {"identity": handle.read().strip(), "workdir": os.path.realpath(workdir)}
    if "hashes" in request:  # what a launch asks next: which objects the store lacks
        answer.update(cmd_have(args, request))
    return answer


def cmd_listen(args: list, request: dict) -> dict:
    """Listen on a port for a while in a detached process (preflight's reachability test); returns its pid."""
    port, seconds = int(args[0]), float(args[1])
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "_serve", str(port), str(seconds)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 5
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return {"pid": proc.pid, "port": port}
        except OSError:
            if proc.poll() is not None:
                return {"error": f"cannot listen on port {port}"}
            time.sleep(0.05)
    return {"error": f"listener on port {port} did not come up"}


def cmd_serve(args: list, request: dict) -> dict:
    port, deadline = int(args[0]), time.time() + float(args[1])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("", port))
        server.listen(128)
        server.settimeout(0.2)
        while time.time() < deadline:
            try:
                conn, _ = server.accept()
                conn.close()
            except OSError:
                pass
    return {}


def cmd_unlisten(args: list, request: dict) -> dict:
    pid = int(args[0])
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            if b"_serve" in handle.read():
                os.kill(pid, signal.SIGTERM)
    except OSError:
        pass
    return {}


def cmd_connect(args: list, request: dict) -> dict:
    host, port = args[0], int(args[1])
    started = time.time()
    try:
        with socket.create_connection((host, port), timeout=float(request.get("timeout", 5))):
            return {"ok": True, "ms": (time.time() - started) * 1000}
    except OSError as exc:
        return {"ok": False, "error": str(exc) or exc.__class__.__name__}


def cmd_route(args: list, request: dict) -> dict:
    """The interface this node sends to ADDR through (ip route get), or null where ip is missing."""
    try:
        proc = subprocess.run(["ip", "route", "get", args[0]], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {"dev": None}
    words = proc.stdout.split()
    return {"dev": words[words.index("dev") + 1] if "dev" in words else None, "raw": proc.stdout.strip()}


PULL_TIMEOUT = 6 * 3600


def cmd_pull(args: list, request: dict) -> dict:
    """A resumed attempt's outputs back from the run's bucket (lib/nodectl_outputs.py with this Python, which has
    boto3; the credentials in env.sh reach it through the environment, never a command line)."""
    run_dir = os.path.expanduser(args[0])
    if not os.path.isfile(os.path.join(run_dir, "lib", "outputs.json")):
        return {"error": f"{run_dir} has no lib/outputs.json: the run was prepared without outputs:"}
    script = 'set -a; . "$1/env.sh"; set +a; exec "$2" "$1/lib/nodectl_outputs.py" pull "$1"'
    code, out, err = _quiet(["/bin/bash", "-c", script, "pull", run_dir, sys.executable], PULL_TIMEOUT,
                            stdin=json.dumps({"sources": request.get("sources") or []}))
    answer = _last_json(out)
    if answer is None:
        return {"error": f"the pull exited {code}: {(err or out).strip()[-400:]}"}
    return answer


def cmd_cleanup(args: list, request: dict) -> dict:
    path = os.path.expanduser(args[0])
    if os.path.exists(path):
        os.unlink(path)
    return {}


COMMANDS = {"have": cmd_have, "prepare": cmd_prepare, "port": cmd_port, "start": cmd_start, "poll": cmd_poll,
            "tail": cmd_tail, "stop": cmd_stop, "stacks": cmd_stacks, "pack": cmd_pack, "cleanup": cmd_cleanup,
            "listen": cmd_listen, "_serve": cmd_serve, "unlisten": cmd_unlisten, "connect": cmd_connect,
            "route": cmd_route, "identity": cmd_identity, "receive": cmd_receive, "diagnose": cmd_diagnose,
            "container": cmd_container, "env_status": cmd_env_status, "env_build": cmd_env_build,
            "fill": cmd_fill, "pull": cmd_pull}
STREAMING = {"receive", "fill"}  # read their stdin themselves


def _read_exactly(fd: int, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        block = os.read(fd, count - len(data))
        if not block:
            raise ValueError("the request ended early")
        data += block
    return bytes(data)


def _stream_request() -> dict:
    """A streaming command's request comes first on stdin: its length on a line, then the JSON. Read from the
    descriptor itself, byte-exact, so the stream that follows is untouched for tar."""
    line = b""
    while not line.endswith(b"\n"):
        if len(line) > 20:
            raise ValueError("no request before the stream")
        line += _read_exactly(0, 1)
    return json.loads(_read_exactly(0, int(line)) or b"{}")


def main() -> None:
    name, args = sys.argv[1], sys.argv[2:]
    try:
        if name in STREAMING:
            request = _stream_request()
        else:
            raw = sys.stdin.read()
            request = json.loads(raw) if raw.strip() else {}
        if not isinstance(request, dict):
            raise ValueError("the request is not a JSON object")
    except (ValueError, RecursionError) as exc:
        sys.stdout.write(json.dumps({"error": f"{name}: malformed request ({exc.__class__.__name__})"}) + "\n")
        return
    try:
        _guard(name, args, request)
        answer = COMMANDS[name](args, request)
    except Unsafe as exc:
        answer = {"error": str(exc), "unsafe": {"path": exc.path, "why": exc.why}}
    except NotARun as exc:
        answer = {"error": f"no run at {exc} (not a run folder: <workdir>/runs/<run id>[/<node>])"}
    except Exception as exc:  # reported to the controller, which shows it with the node's name
        answer = {"error": f"{name}: {exc.__class__.__name__}: {exc}"}
    sys.stdout.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
