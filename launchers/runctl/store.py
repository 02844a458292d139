"""The content-addressed object store under <workdir>/.nodectl/objects: what a node has, receiving a tar stream, the workdir storage identity (one call with have)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tarfile

from runctl.common import boot_id, read_json, write_file
from runctl.runfolder import cmd_prepare


# Store objects carry this mtime. Run folders hard-link them (one write per byte on the node, not two), so a
# program that writes into its own code file in place changes the object too. An object is trusted for a later
# run only by its content: its sha256 is its name, checked again whenever the inode's ctime moved since the last
# check (any write, or a mtime put back with utime, moves the ctime, which no user can set), and remembered per
# object in VERIFIED (beside the store, in the login user's .nodectl). A changed object counts as missing: it is sent
# again under a new inode and the changed bytes stay with the run that wrote them.
STORE_MTIME = 946684800  # 2000-01-01
VERIFIED = "objects-verified.json"   # beside the store (.nodectl/), which holds objects only


def _intact(path: str, size, verified: dict) -> bool:
    try:
        info = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISREG(info.st_mode) or (size is not None and info.st_size != size):
        return False
    seen = f"{info.st_ino}:{info.st_size}:{info.st_mtime_ns}:{info.st_ctime_ns}"
    name = os.path.basename(path)
    if verified.get(name) == seen:
        return True
    if int(info.st_mtime) != STORE_MTIME or _hash_file(path) != name:
        verified.pop(name, None)
        return False
    verified[name] = seen
    return True


def cmd_have(args: list, request: dict) -> dict:
    """Which of the given content hashes the node's object store lacks (or holds changed since it arrived)."""
    store = os.path.join(os.path.expanduser(args[0]), ".nodectl", "objects")
    sizes = request.get("sizes") or {}
    verified = read_json(os.path.join(os.path.dirname(store), VERIFIED), {})
    verified = verified if isinstance(verified, dict) else {}
    missing = [h for h in request["hashes"] if not _intact(os.path.join(store, h), sizes.get(h), verified)]
    if os.path.isdir(store):
        write_file(os.path.join(os.path.dirname(store), VERIFIED), json.dumps(verified), 0o600)
    return {"missing": missing}


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
    if hasattr(os, "sched_getaffinity"):  # the CPUs this login's ranks may use, and the kernel they share
        allowed = sorted(os.sched_getaffinity(0))
        answer["cpu"] = {"available": len(allowed), "cpu_set": allowed, "boot_id": boot_id()}
    if "hashes" in request:  # what a launch asks next: which objects the store lacks
        answer.update(cmd_have(args, request))
    return answer
