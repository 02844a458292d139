"""What leaves or reaches a run folder after the fact: pack (collect), fill (node 0's outputs), pull (the bucket)."""
from __future__ import annotations

import errno
import io
import json
import os
import shutil
import stat
import sys
import tarfile
import time

import runlayout as layout
from redaction import redact_tree, redact_words
from runctl.common import LinkRefused, is_file, lstat_nofollow, no_run, quiet, read_json, walk
from nodeio import last_json, update_json
from runctl.runfolder import SYNCED_CODE
from runctl.store import STREAM_BUFFER


def cmd_pack(args: list, request: dict) -> dict:
    """A tar.gz of the run's results (not code/ or lib/, not env.sh or launch.sh, which hold the real secrets;
    the controller keeps their redacted copies) for `collect` to fetch, plus the run-relative paths in
    request["also"] (a script's `--output_dir out` lands in code/out). Files that vanish while it is packed (a
    checkpoint rotating out) are counted, not an error; what is neither a file, a folder nor a link to a sibling
    (a fifo, a socket, a device, a link out of the run) is left out and counted."""
    run_dir = args[0]   # its real path (dispatch's guard)
    if not is_file(os.path.join(run_dir, layout.NODE_JSON)):
        return no_run(run_dir)
    only = request.get("only")   # top-level folders alone (output/ for `fill`), packed without compression
    target = os.path.join(run_dir, ".collect.tar" if only else ".collect.tar.gz")
    synced = set(read_json(os.path.join(run_dir, SYNCED_CODE), []) or [])
    # "code": what the program wrote in code/ (its relative --output_dir), brought back and named
    packed = {"count": 0, "vanished": 0, "skipped": [], "missing": [], "names": set(), "code": []}
    try:
        _pack(run_dir, target, only, synced, request, packed)
    except CallerGone:   # the controller was killed (SIGKILL) while this packed: nobody will fetch or remove it
        if os.path.exists(target):
            os.unlink(target)
        sys.exit(1)
    _reap_later(target)
    return {"archive": target, "entries": packed["count"], "vanished": packed["vanished"],
            "skipped": packed["skipped"][:50], "missing": packed["missing"], "bytes": os.path.getsize(target),
            "code_written": len(packed["code"]), "code_examples": packed["code"][:5], "code_left": len(synced)}


REAP_AFTER = 15.0   # seconds the controller has to open the archive (it does at once: collect_node, _fetch_output)


def _reap_later(target: str) -> None:
    """A controller killed (SIGKILL) after the pack but before it opened the archive cannot take it away, and the
    packing can no longer see it go: a detached child removes the archive after REAP_AFTER seconds unless it is
    gone by then (the controller's fetch unlinks it as soon as it is open for reading). The child holds none of
    this call's descriptors, so the answer is not kept waiting for it."""
    try:
        info = os.stat(target, follow_symlinks=False)
        first = os.fork()
    except OSError:
        return
    if first:
        os.waitpid(first, 0)
        return
    try:   # the first child: a session of its own, then gone, leaving the second to init
        os.setsid()
        if os.fork():
            os._exit(0)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(3, 65536)
        time.sleep(REAP_AFTER)
        now = os.stat(target, follow_symlinks=False)
        if (now.st_dev, now.st_ino, now.st_ctime_ns) == (info.st_dev, info.st_ino, info.st_ctime_ns):
            os.unlink(target)   # this very archive, untouched since: a later pack's (even on a reused inode) is not
    except BaseException:  # noqa: BLE001 - gone (fetched) or anything else: the child only ever exits
        pass
    os._exit(0)


class CallerGone(Exception):
    """The other end of this runctl's stdout is closed: the controller (or its SSH connection) is gone."""


def _check_caller() -> None:
    """A write end whose reader is gone polls as POLLERR (a pipe) or POLLHUP (a socket): checked for each file
    packed, which costs a system call, so a controller killed by SIGKILL leaves no archive on the node."""
    import select
    poller = select.poll()
    poller.register(sys.stdout.fileno(), 0)
    if any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0)):
        raise CallerGone


def _pack(run_dir: str, target: str, only, synced: set, request: dict, packed: dict) -> None:
    """The run folder walked by descriptors (os.fwalk: no link followed, every file opened relative to its folder
    without following a link), so a folder or file a rank swapped for a link mid-walk is left out, never read."""
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w" if only else "w:gz") as tar:
        for folder, dirs, names, dir_fd in os.fwalk(run_dir):
            relative = os.path.relpath(folder, run_dir)
            if relative == ".":
                dirs[:] = [d for d in dirs if d != "lib" and (not only or d in only) and (d != "code" or synced)]
                names = [] if only else [n for n in names
                                         if n not in layout.SECRET_FILES and not n.startswith(".collect")]
            elif os.path.basename(relative) == layout.FLIGHT:   # flight/, and attempts/<n>/flight/
                names = [n for n in names if not n.endswith((".request", ".sock"))]   # the listeners' FIFOs, the worker servers' sockets
                for name in [n for n in names if n.endswith(".answer.json")]:
                    names.remove(name)
                    _pack_answer(tar, dir_fd, name, os.path.normpath(os.path.join(relative, name)), packed)
            elif relative == "code" or relative.startswith("code/"):
                dirs[:] = [d for d in dirs if d != "__pycache__"]
                inside = relative[len("code/"):] if relative != "code" else ""
                names = [n for n in names if os.path.join(inside, n) not in synced and not _placing(n)]
                packed["code"] += [os.path.join(inside, n) for n in names]
            _pack_entries(tar, dir_fd, relative, names, dirs, packed)
        for also in request.get("also") or []:
            _pack_also(tar, run_dir, also, packed)
    _check_caller()


ANSWER_LIMIT = 64 << 20   # a listener's answer: stacks and a trimmed flight record, a few MiB at most


def _pack_answer(tar, dir_fd: int, name: str, arcname: str, packed: dict) -> None:
    """A rank's listener answer (flight/rank<R>.answer.json) as collect may bring it home: it quotes the program's
    source lines where each thread stands, so a token on one of them is masked where it stands (the diagnosis
    masks the same lines when it shows them). One that is not JSON is masked as text; one over ANSWER_LIMIT, or
    not a plain file, is left out and counted."""
    if arcname in packed["names"]:
        return
    packed["names"].add(arcname)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        packed["vanished"] += 1
        return
    except OSError:
        packed["skipped"].append(arcname)
        return
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > ANSWER_LIMIT:
            packed["skipped"].append(arcname)
            return
        text = handle.read(ANSWER_LIMIT).decode("utf-8", "replace")
    try:
        data = json.dumps(redact_tree(json.loads(text))).encode()
    except (ValueError, RecursionError):
        data = redact_words(text).encode()
    member = tarfile.TarInfo(arcname)
    member.size, member.mtime, member.mode = len(data), info.st_mtime, stat.S_IMODE(info.st_mode)
    tar.addfile(member, io.BytesIO(data))
    packed["count"] += 1


def _placing(name: str) -> bool:
    """A temporary name `prepare` places a code file under (<name>.<pid>.tmp): nodectl's, never the program's."""
    parts = name.rsplit(".", 2)
    return len(parts) == 3 and parts[2] == "tmp" and parts[1].isdigit()


def _pack_also(tar, run_dir: str, also: str, packed: dict) -> None:
    """One more path inside the run folder (relative, no `..`, never the files that hold secrets)."""
    parts = [p for p in str(also).split("/") if p not in ("", ".")]
    if not parts or ".." in parts or str(also).startswith("/") or parts[-1] in layout.SECRET_FILES:
        packed["missing"].append(f"{also} (not a path inside the run folder)")
        return
    path = os.path.join(run_dir, *parts)
    info = lstat_nofollow(path)
    if info is None:
        packed["missing"].append(f"{also} (not there)")
        return
    if stat.S_ISDIR(info.st_mode):
        for folder, dirs, names, dir_fd in os.fwalk(path):
            _pack_entries(tar, dir_fd, os.path.relpath(folder, run_dir), names, dirs, packed)
        return
    try:
        parent = walk(os.path.dirname(path))
    except OSError:
        packed["missing"].append(f"{also} (reached through a link: not followed)")
        return
    try:
        _pack_entries(tar, parent, os.path.relpath(os.path.dirname(path), run_dir), [parts[-1]], [], packed)
    finally:
        os.close(parent)


def _pack_entries(tar, dir_fd: int, relative: str, names: list, dirs: list, packed: dict) -> None:
    """Regular files (opened without following a link, their metadata from the open file) and links to a sibling
    name (output/adapter -> adapter-<step>); anything else is counted as left out."""
    links = [d for d in dirs if _is_link(d, dir_fd)]
    for name in sorted(names + links):
        arcname = os.path.normpath(os.path.join(relative, name))
        if arcname in packed["names"]:   # a --path entry that the walk packed already
            continue
        packed["names"].add(arcname)
        _check_caller()
        try:
            info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISLNK(info.st_mode):
                target = os.readlink(name, dir_fd=dir_fd)
                if not _sibling_link(target):
                    packed["skipped"].append(arcname)
                    continue
                member = tarfile.TarInfo(arcname)
                member.type, member.linkname, member.mtime, member.mode = tarfile.SYMTYPE, target, info.st_mtime, 0o777
                tar.addfile(member)
            elif stat.S_ISREG(info.st_mode):
                _pack_file(tar, dir_fd, name, arcname, packed)
            else:
                packed["skipped"].append(arcname)
                continue
            packed["count"] += 1
        except FileNotFoundError:
            packed["vanished"] += 1
        except LinkRefused:   # swapped for a link between the listing and the open
            packed["skipped"].append(arcname)


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:   # gone since the listing (a checkpoint rotating out)
        return False


def _pack_file(tar, dir_fd: int, name: str, arcname: str, packed: dict) -> None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):
            raise LinkRefused(exc.errno, arcname) from None
        raise
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise LinkRefused(errno.EINVAL, arcname)
        member = tarfile.TarInfo(arcname)
        member.size, member.mtime, member.mode = info.st_size, info.st_mtime, stat.S_IMODE(info.st_mode)
        tar.addfile(member, _Exactly(handle, info.st_size))


class _Exactly:
    """A file read as exactly `size` bytes (what its header says), whether it grew or shrank since: a log still
    written to must not break the archive."""
    def __init__(self, handle, size: int) -> None:
        self.handle, self.left = handle, size

    def read(self, count: int = -1) -> bytes:
        count = self.left if count is None or count < 0 else min(count, self.left)
        data = self.handle.read(count)
        data += b"\0" * (count - len(data))
        self.left -= count
        return data


def cmd_fill(args: list, request: dict) -> dict:
    """Add to the run's output/ what a tar stream on stdin (another node's output/, from `pack` with `only`) holds
    and this node lacks, before a resumed attempt starts: a third-party trainer's checkpoint that global rank 0
    alone wrote (transformers writes the weights on rank 0 only) becomes whole on every node, while each node
    keeps what it wrote itself (its ranks' rng states). Nothing here is replaced; only regular files, folders and
    links to a sibling name are taken; every name stays inside output/; every folder is reached a name at a time
    from output/ itself (a folder a rank replaced with a link is refused, never written through); a file lands
    under a temporary name and is renamed once whole, so a cut stream leaves no partial file. A name the node's
    file system refuses (too long, say) is one refused entry; the rest is still filled."""
    output = os.path.join(args[0], "output")
    done = {"added": 0, "bytes": 0, "kept": 0, "refused": []}
    root = walk(output, create=True)
    try:
        with tarfile.open(fileobj=sys.stdin.buffer, mode="r|", bufsize=STREAM_BUFFER) as tar:
            for member in tar:
                parts = [p for p in member.name.split("/") if p not in ("", ".")]
                if member.name.startswith("/") or ".." in parts or parts[:1] != ["output"]:
                    done["refused"].append(member.name[:200])
                    continue
                if len(parts) == 1:
                    continue
                try:
                    _fill_member(tar, member, root, parts[1:], done)
                except (OSError, ValueError) as exc:
                    done["refused"].append(f"{member.name[:200]} ({getattr(exc, 'strerror', None) or exc})"[:300])
    finally:
        os.close(root)
    if done.get("borrowed"):   # node 0's files: its own uploader sent them, this node's does not send them again
        update_json(os.path.join(args[0], layout.BORROWED), done.pop("borrowed"))
    done["refused"] = done["refused"][:50]
    return done


def _fill_member(tar, member, root: int, parts: list, done: dict) -> None:
    folder = _folder_inside(root, parts[:-1])
    try:
        name = parts[-1]
        try:
            os.stat(name, dir_fd=folder, follow_symlinks=False)
            done["kept"] += not member.isdir()
            return
        except FileNotFoundError:
            pass
        if member.isdir():
            os.mkdir(name, 0o700, dir_fd=folder)
        elif member.issym() and _sibling_link(member.linkname):
            os.symlink(member.linkname, name, dir_fd=folder)
        elif member.isfile():
            _fill_file(tar.extractfile(member), folder, name)
            done["added"], done["bytes"] = done["added"] + 1, done["bytes"] + member.size
            info = os.stat(name, dir_fd=folder, follow_symlinks=False)
            done.setdefault("borrowed", {})["/".join(["output", *parts])] = [info.st_size, info.st_mtime_ns]
        else:
            raise ValueError("not a file, a folder or a link to a sibling")
    finally:
        if folder != root:
            os.close(folder)


def _folder_inside(root: int, parts: list) -> int:
    """A descriptor of root/parts..., each folder created (0700) where missing and opened without following a
    link; LinkRefused where one is a link or not a folder."""
    fd = root
    for part in parts:
        try:
            next_fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        except FileNotFoundError:
            os.mkdir(part, 0o700, dir_fd=fd)
            next_fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        except OSError as exc:
            if fd != root:
                os.close(fd)
            raise LinkRefused(exc.errno, f"{part} is a link or not a folder: not followed") from None
        if fd != root:
            os.close(fd)
        fd = next_fd
    return fd


def _fill_file(source, folder: int, name: str) -> None:
    tmp = f"{name[:200]}.fill{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=folder)
    try:
        with os.fdopen(fd, "wb") as handle:
            shutil.copyfileobj(source, handle, STREAM_BUFFER)
        os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        os.unlink(tmp, dir_fd=folder)
        raise


def _sibling_link(target: str) -> bool:
    """A link the controller can keep: to a name in the same folder (adapter -> adapter-100), not out of it."""
    return bool(target) and "/" not in target and target not in (".", "..")


PULL_TIMEOUT = 6 * 3600


def cmd_pull(args: list, request: dict) -> dict:
    """A resumed attempt's outputs back from the run's bucket (lib/nodectl_outputs.py with this Python, which has
    boto3; the credentials in env.sh reach it through the environment, never a command line)."""
    run_dir = os.path.expanduser(args[0])
    if not os.path.isfile(os.path.join(run_dir, "lib", "outputs.json")):
        return {"error": f"{run_dir} has no lib/outputs.json: the run was prepared without outputs:"}
    script = 'set -a; . "$1/env.sh"; set +a; exec "$2" "$1/lib/nodectl_outputs.py" pull "$1"'
    code, out, err = quiet(["/bin/bash", "-c", script, "pull", run_dir, sys.executable], PULL_TIMEOUT,
                            stdin=json.dumps({"sources": request.get("sources") or []}))
    answer = last_json(out)
    if answer is None:
        return {"error": f"the pull exited {code}: {(err or out).strip()[-400:]}"}
    return answer


def cmd_cleanup(args: list, request: dict) -> dict:
    path = os.path.expanduser(args[0])
    if lstat_nofollow(path) is not None:
        os.unlink(path)
    return {}
