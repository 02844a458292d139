"""Code sync: the project folder (minus what .gitignore excludes) and nodectl's own node-side files, sent to each
node through a content-addressed store under <workdir>/.nodectl/objects, so a file whose content a node already
has is never sent again."""
from __future__ import annotations

import atexit
import fcntl
import hashlib
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from nodectl.remote import agent
from nodectl.errors import Cancelled, UsageError
from nodectl.resources import NODE_TRAINER, resource_dir
from nodectl.transport import StreamSink, Transport
from nodectl.remote.client import NodeClient

DEFAULT_SYNC_LIMIT = 512 * 2**20
# A file written to within this many seconds may still be written to while it is sent (a log, an output, nohup.out):
# it is sent as a snapshot taken while hashing it, so what arrives is what was hashed, consistent.
LIVE_SECONDS = 120
EDITOR_FILES = (".swp", ".swo", ".swx", "~")   # vim swap files, emacs and gedit backups; `.#name` emacs locks


@dataclass(frozen=True)
class SyncFile:
    path: str        # where it lands, relative to the node's run folder (code/..., lib/..., config/...)
    source: Path
    sha256: str
    mode: int
    size: int

    def entry(self) -> dict:
        return {"path": self.path, "sha256": self.sha256, "mode": self.mode}


def _hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _git_files(root: Path) -> list[str] | None:
    try:
        proc = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                              capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    return [p for p in proc.stdout.decode().split("\0") if p]


def _always_excluded(name: str) -> bool:
    parts = name.split("/")
    return (parts[0] == "runs" or name.endswith(".pyc") or name.endswith(EDITOR_FILES)
            or parts[-1].startswith(".#") or any(p in (".git", "__pycache__", ".nodectl") for p in parts[:-1]))


def _own_output() -> set[tuple[int, int]]:
    """(device, inode) of the files this process's stdout and stderr write to: `nodectl launch > launch.log`
    inside the project must not send launch.log, which grows all along."""
    out = set()
    for fd in (1, 2):
        try:
            info = os.fstat(fd)
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode):
            out.add((info.st_dev, info.st_ino))
    return out


_SNAPSHOTS: list[str] = []
SNAPSHOT_PREFIX = "nodectl-snapshots-"
# A folder this young may be one another nodectl has just made and not yet locked.
SNAPSHOT_SETTLE_SECONDS = 60


def _snapshot_folder() -> Path:
    """This process's folder of snapshots, removed when it exits. A process killed with SIGKILL (or by a power
    cut) cannot remove its own: each folder is locked (flock, on the folder itself) for as long as its process
    lives, and the next nodectl to make one removes every folder of its user whose lock it can take."""
    if not _SNAPSHOTS:
        _reclaim_snapshot_folders()
        folder = tempfile.mkdtemp(prefix=SNAPSHOT_PREFIX)
        held = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)   # not inherited by what this process runs
        fcntl.flock(held, fcntl.LOCK_EX)   # released by the kernel however this process ends
        _SNAPSHOTS.append(folder)
        atexit.register(shutil.rmtree, folder, True)
    return Path(_SNAPSHOTS[0])


def _reclaim_snapshot_folders() -> None:
    """Remove the snapshot folders nodectl processes that were killed left in the temp folder: this user's,
    older than SNAPSHOT_SETTLE_SECONDS, whose lock nobody holds. A folder held by a live nodectl, in any PID
    namespace sharing this temp folder, is left alone, as is another user's."""
    base = tempfile.gettempdir()
    try:
        names = [name for name in os.listdir(base) if name.startswith(SNAPSHOT_PREFIX)]
    except OSError:
        return
    for name in names:
        path = os.path.join(base, name)
        try:
            held = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            info = os.fstat(held)
            if info.st_uid != os.getuid() or time.time() - info.st_mtime < SNAPSHOT_SETTLE_SECONDS:
                continue
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue   # held: its process lives
        finally:
            os.close(held)
        shutil.rmtree(path, ignore_errors=True)


def _snapshot(source: Path) -> tuple[Path, str, int]:
    """A private copy of a file that may be written to meanwhile, hashed as it is copied: (copy, sha256, size)."""
    digest = hashlib.sha256()
    fd, copy = tempfile.mkstemp(dir=_snapshot_folder())
    size = 0
    with open(source, "rb") as handle, os.fdopen(fd, "wb") as out:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
            out.write(block)
            size += len(block)
    return Path(copy), digest.hexdigest(), size


def _walk_files(root: Path) -> list[str]:
    """Outside git: every file, minus what the root .gitignore excludes (matched as git would)."""
    ignore = root / ".gitignore"
    spec = None
    if ignore.is_file():
        import pathspec

        spec = pathspec.PathSpec.from_lines("gitwildmatch", ignore.read_text(encoding="utf-8", errors="replace")
                                            .splitlines())
    files = []
    for folder, dirs, names in os.walk(root):
        rel_folder = os.path.relpath(folder, root)
        rel = [os.path.normpath(os.path.join(rel_folder, d)) for d in dirs]
        dirs[:] = [d for d, r in zip(dirs, rel) if not _always_excluded(r + "/x")
                   and not (spec and spec.match_file(r + "/"))]
        files += [os.path.normpath(os.path.join(rel_folder, n)) for n in names]
    return [f for f in files if not _always_excluded(f) and not (spec and spec.match_file(f))]


@dataclass(frozen=True)
class Withheld:
    """A project file that does not travel, and why (the inventory in use; a file holding one of its secrets)."""
    name: str
    why: str


def project_files(root: str | Path, limit: int = DEFAULT_SYNC_LIMIT, inventory: str | None = None,
                  secrets: tuple[str, ...] = (), withheld: list | None = None) -> list[SyncFile]:
    """The project's files as they travel. The inventory in use (`inventory`) never does: it is the controller's
    (its env: reaches a node only in its 0600 env.sh); nor does a file holding one of `secrets` (the values of
    the inventory's secret env: settings). Each file left out so is appended to `withheld`."""
    root = Path(root)
    if not root.is_dir():
        raise UsageError(f"--sync {root}: not a folder")
    names = _git_files(root)
    if names is None:
        names = _walk_files(root)
    files, total, own, now = [], 0, _own_output(), time.time()
    inside = os.path.realpath(root) + os.sep
    inventory_real = os.path.realpath(inventory) if inventory else None
    withheld = withheld if withheld is not None else []
    needles = tuple(s.encode() for s in secrets if len(s) >= 8)
    for name in sorted(set(names)):
        source = root / name
        if _always_excluded(name) or not source.is_file() or source.is_symlink():
            continue
        if not os.path.realpath(source).startswith(inside):   # reached through a linked folder: not the project's
            continue
        if os.path.realpath(source) == inventory_real:
            withheld.append(Withheld(name, "the inventory in use: its env: reaches the nodes in env.sh alone"))
            continue
        info = source.stat()
        if (info.st_dev, info.st_ino) in own:
            continue
        if needles and info.st_size <= SECRET_SCAN_LIMIT and _holds_any(source, needles):
            withheld.append(Withheld(name, "it holds the value of a secret setting of the inventory's env:"))
            continue
        total += info.st_size
        if total > limit:
            raise UsageError(f"--sync {root}: more than {limit / 2**20:.0f} MiB to send (at {name}); exclude data "
                             f"and outputs in .gitignore, or raise the cap with --sync-limit MiB")
        if now - info.st_mtime < LIVE_SECONDS:
            copy, sha256, size = _snapshot(source)
            files.append(SyncFile(f"code/{name}", copy, sha256, info.st_mode & 0o777, size))
        else:
            files.append(SyncFile(f"code/{name}", source, _hash(source), info.st_mode & 0o777, info.st_size))
    return files


SECRET_SCAN_LIMIT = 16 * 2**20   # larger files (data, weights) are not read for secrets


def _holds_any(path: Path, needles: tuple[bytes, ...]) -> bool:
    try:
        data = path.read_bytes()
    except OSError:
        return False
    return any(needle in data for needle in needles)


def _tree(base: Path, prefix: str) -> list[SyncFile]:
    out = []
    for source in sorted(base.rglob("*")):
        if source.is_file() and "__pycache__" not in source.parts and source.suffix != ".pyc":
            rel = source.relative_to(base).as_posix()
            out.append(SyncFile(f"{prefix}/{rel}", source, _hash(source), 0o644, source.stat().st_size))
    return out


def nodectl_files(builtin_trainer: bool, config: str | None, launchers_needed: tuple[str, ...] = ()) -> list[SyncFile]:
    """rankexec.py, nodectl_metrics.py and sitecustomize.py (the diagnose listener and pace thread) always, with
    runlayout.py, nodeio.py and flightpace.py, the run folder's names, the whole-file writer and the pace's reading
    of the flight recorder they share with runctl, framework_phases.py (HF Trainer's and Lightning's phases
    for the goodput ledger) and elastic_agent.py (torchrun's agent, as launch.sh starts it); plus any other
    launcher a job runs; the
    built-in trainer and its recipe when it is what runs."""
    launchers = resource_dir("launchers")
    files = [SyncFile(f"lib/{name}", launchers / name, _hash(launchers / name), 0o644, (launchers / name).stat().st_size)
             for name in ("rankexec.py", "nodectl_metrics.py", "sitecustomize.py", "runlayout.py", "nodeio.py", "flightpace.py",
                          "framework_phases.py", "elastic_agent.py", *launchers_needed)]
    if builtin_trainer:
        files += _tree(resource_dir("trainer"), f"lib/{NODE_TRAINER}")
    if config:
        path = Path(config)
        files.append(SyncFile(f"config/{path.name}", path, _hash(path), 0o644, path.stat().st_size))
    return files


TAR_BLOCK, TAR_RECORD = 512, 10240
# Streams in flight at once, whatever the fan-out. One ssh stream is bound by a core's AES-GCM (1-3 GB/s), so
# 16 fill a 100 Gb/s link; more only add ssh clients (8 MiB of RSS each) competing for the same cores and
# link. At 32 nodes on 2 cores, 16 at a time finished as soon as 32 did.
MAX_STREAMS = 16
_STREAMS = threading.BoundedSemaphore(MAX_STREAMS)


def _tar_header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mode = size, 0o600
    return info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")  # GNU: sizes past 8 GiB


def _changed(file: SyncFile) -> UsageError:
    return UsageError(f"--sync: {file.source} changed while it was being sent (a log or output written inside the "
                      f"project folder?); exclude it in .gitignore or write it elsewhere")


def _add_unchanged(sink: StreamSink, file: SyncFile) -> int:
    """Stream one file as a tar member named by its content's hash, or refuse one whose size changed since it
    was hashed (a log inside the project folder). The node hashes every object and keeps none that does not
    match its name, so a change that keeps the size is refused too, by the node's answer (see send_objects).
    Returns the bytes it added to the stream."""
    with open(file.source, "rb") as handle:
        if os.fstat(handle.fileno()).st_size != file.size:
            raise _changed(file)
        sink.write(_tar_header(file.sha256, file.size))
        if sink.send_file(handle, file.size) != file.size or os.fstat(handle.fileno()).st_size != file.size:
            raise _changed(file)
    padding = -file.size % TAR_BLOCK
    if padding:
        sink.write(bytes(padding))
    return TAR_BLOCK + file.size + padding


def have_request(files: list[SyncFile]) -> dict:
    """What runctl's `have` (and `identity`) take to answer which objects a node's store lacks."""
    unique = {f.sha256: f for f in files}
    return {"hashes": sorted(unique), "sizes": {sha: f.size for sha, f in unique.items()}}


def missing_objects(transport: Transport, files: list[SyncFile]) -> list[str]:
    return NodeClient(transport).have(have_request(files)).missing


def send_objects(transport: Transport, files: list[SyncFile], missing: list[str],
                 cancel: threading.Event | None = None, then: dict | None = None) -> tuple[int, object]:
    """Stream the `missing` objects into the node's store (runctl receive) and, in the same call, do `then`
    (a `prepare` request) once they are in; returns (bytes sent, the node's answer).

    The stream is a tar of the objects, each named by its hash, built as it goes: file contents move from the
    page cache into the ssh client's pipe inside the kernel (sendfile), so neither memory nor temporary space
    grows with the project or the node count, and no byte crosses Python. When `cancel` is set the stream is
    cut at the next block; the node keeps only complete objects, and prepares nothing."""
    unique = {f.sha256: f for f in files}
    sent = {"bytes": 0}

    def produce(sink: StreamSink) -> None:
        def checked() -> None:
            if cancel is not None and cancel.is_set():
                raise Cancelled("interrupted while sending the project")

        sink.check = checked
        total = 0
        for sha in missing:
            checked()
            total += _add_unchanged(sink, unique[sha])
        end = 2 * TAR_BLOCK + (-(total + 2 * TAR_BLOCK) % TAR_RECORD)
        sink.write(bytes(end))
        sent["bytes"] = total + end

    try:
        with _STREAMS:
            answer = NodeClient(transport).receive(produce, prepare=then)
    except agent.AgentError as exc:
        corrupted = [unique[sha] for sha in missing if sha in str(exc)]
        if corrupted:
            raise _changed(corrupted[0]) from None
        raise
    return sent["bytes"], answer


def upload_missing(transport: Transport, files: list[SyncFile], cancel: threading.Event | None = None) -> int:
    """Send whatever of `files` the node's store lacks; returns the bytes sent."""
    missing = missing_objects(transport, files)
    return send_objects(transport, files, missing, cancel)[0] if missing else 0
