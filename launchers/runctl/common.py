"""What every job shares: reading and writing the run folder's files, the node-side trust rule, quiet subprocesses."""
from __future__ import annotations

import json
import os
import stat
import subprocess

import nodeio
from nodeio import LinkRefused, is_file, listdir_nofollow, lstat_nofollow, open_nofollow, walk  # noqa: F401 - for runctl's modules


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


def no_run(run_dir: str, why: str = "") -> dict:
    """The answer for a run this node does not have (never prepared, or removed): the controller reads the flag,
    never the words."""
    return {"error": f"no run at {run_dir}{why}", "no_run": True}


def _owner(uid: int) -> str:
    try:
        import pwd
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _writable_by_others(info) -> bool:
    return bool(info.st_mode & 0o022)


def resolve_workdir(workdir: str) -> str:
    """The workdir's real path, judged like OpenSSH's StrictModes on the way: every folder and link on the path is
    root's or yours (another user could rename or re-point it), and a folder other users can write is sticky (so
    they cannot rename what is in it): a link another user planted in /scratch is refused, naming the link, its
    owner and the fix. A missing rest of the path is returned as written, to be made by you. The same walk runs
    where this module cannot be imported: the installer's bootstrap (nodectl/remote/agent.py, _WALK) and
    preflight's probe (launchers/probe.py, _unsafe_path)."""
    uid, path = os.getuid(), os.path.abspath(os.path.expanduser(workdir))
    pending, current, hops = [p for p in path.split("/") if p], "/", 0
    while pending:
        name = pending.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            current = os.path.dirname(current)
            continue
        candidate = os.path.join(current, name)
        try:
            info, above = os.lstat(candidate), os.lstat(current)
        except FileNotFoundError:
            return os.path.join(candidate, *pending)
        is_link = stat.S_ISLNK(info.st_mode)
        if info.st_uid not in (uid, 0):
            what = f"a symbolic link (to {os.readlink(candidate)})" if is_link else "a folder"
            raise Unsafe(candidate, f"{what} owned by {_owner(info.st_uid)}, not by you ({_owner(uid)}) or root"
                                    + (f", in {current}, which other users can write" if _writable_by_others(above)
                                       else "") + f": whoever owns it chooses where nodectl writes; use a workdir "
                                    f"of your own (e.g. mkdir -m 700 {current.rstrip('/')}/$USER)")
        if is_link:
            hops += 1
            if hops > 40:
                raise Unsafe(path, "a loop of symbolic links")
            target = os.readlink(candidate)
            pending[:0] = [p for p in target.split("/") if p]
            current = "/" if target.startswith("/") else current
            continue
        if not stat.S_ISDIR(info.st_mode):
            raise Unsafe(candidate, "not a folder")
        if _writable_by_others(info) and not info.st_mode & stat.S_ISVTX and pending:
            raise Unsafe(candidate, f"writable by other users (mode {oct(info.st_mode & 0o7777)}) without the sticky "
                                    f"bit, on the way to the workdir: they could rename or replace what is below it")
        current = candidate
    return current


def trusted_workdir(workdir: str, create: bool = True) -> bool:
    """Whether the workdir exists (made 0700 when missing and `create`); Unsafe when another user could swap what
    nodectl keeps in it, or the path to it."""
    real = resolve_workdir(workdir)
    if create:
        os.makedirs(real, mode=0o700, exist_ok=True)
        real = resolve_workdir(workdir)   # what was made is judged too
    try:
        info = os.lstat(real)
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
    """<workdir>/<parts...> by its real path, the workdir's path and each folder below it checked (and made, with
    `create`)."""
    if trusted_workdir(workdir, create):
        workdir = resolve_workdir(workdir)
        path = workdir
        for part in parts:
            path = os.path.join(path, part)
            if not own_folder(path, create):
                break
    else:
        workdir = resolve_workdir(workdir)
    return os.path.join(workdir, *parts)


def trusted_run_dir(run_dir: str, create: bool = False) -> str:
    """A run folder, <workdir>/runs/<run id>[/<node>], with the rule applied from the workdir down; its real path,
    which every later step reaches a name at a time (nodeio.walk)."""
    run_dir = os.path.expanduser(run_dir).rstrip("/")
    parts = run_dir.split("/")
    for depth in (1, 2):   # <run id>, or <run id>/<node> where nodes share a workdir's disk
        if len(parts) > depth + 1 and parts[-depth - 1] == "runs" and all(p not in ("", ".", "..") for p in parts[-depth:]):
            workdir = "/".join(parts[:-depth - 1]) or "/"
            return trusted_path(workdir, ("runs", *parts[-depth:]), create)
    raise NotARun(run_dir)


def open_run_file(path: str, text: bool = True):
    """A file of a run folder, opened for reading only when it is a regular file reached without a link in any
    component: what a rank (or a container's root) leaves in its folder, a file or a folder replaced by a link,
    is never a way to make runctl read /etc/shadow or hang on a FIFO. OSError otherwise."""
    fd = open_nofollow(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    return os.fdopen(fd, "r", encoding="utf-8") if text else os.fdopen(fd, "rb")


def write_file(path: str, text: str, mode: int = 0o644) -> None:
    """nodeio's whole-file writer, strict: no component of `path` is followed through a link."""
    nodeio.write_file(path, text, mode, strict=True)


def boot_id() -> str | None:
    """This boot of the node's kernel: a run whose ranks vanished in the same boot was killed; in another, the
    node restarted under it."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="utf-8") as handle:
            return handle.read().strip() or None
    except OSError:
        return None


def read_json(path: str, default=None):
    try:
        with open_run_file(path) as handle:
            return json.load(handle)
    except (OSError, ValueError, RecursionError):   # deeply nested JSON is malformed, not a crash
        return default


def quiet(argv: list, timeout: float, stdin: str | None = None) -> tuple:
    """(exit code, stdout, stderr) of a command run without a shell; 127 when it is missing, 124 on timeout."""
    try:
        proc = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        return 127, "", f"{argv[0]}: not found"
    except subprocess.TimeoutExpired:
        return 124, "", f"{' '.join(argv[:3])} did not answer within {timeout:.0f} s"
    return proc.returncode, proc.stdout, proc.stderr


