"""Run folders: laid out from the store (prepare), an earlier attempt archived."""
from __future__ import annotations

import json
import os
import shutil

import runlayout as layout
from runctl.common import walk, write_file
from runctl.processes import run_processes


def place_file(source: str, folder: int, name: str, mode: int) -> None:
    """Put a store object at `name` in the open `folder`: a hard link where the modes agree (the store's objects
    are 0600), else (a program, or a file system that refuses links) a private in-kernel copy. The store was
    hash-checked. Whatever was at `name` (an earlier attempt's copy, a link a rank left) is replaced, never
    written through; no temporary name is left (a rename between two links to one file does nothing)."""
    tmp = f"{name}.{os.getpid()}.tmp"
    try:
        if mode == 0o600:
            try:
                os.link(source, tmp, dst_dir_fd=folder)
                os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
                return
            except OSError:
                pass
        _unlink_quietly(tmp, folder)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=folder)
        with open(source, "rb") as src, os.fdopen(fd, "wb") as dst:   # private before any byte lands
            shutil.copyfileobj(src, dst, 1 << 20)
            os.fchmod(dst.fileno(), mode)
        os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
    finally:
        _unlink_quietly(tmp, folder)


def _unlink_quietly(name: str, folder: int) -> None:
    try:
        os.unlink(name, dir_fd=folder)
    except FileNotFoundError:
        pass


def cmd_prepare(args: list, request: dict) -> dict:
    """Lay out the run folder: code and lib from the object store, the rendered files, the state folders. Every
    folder below the run folder is reached a name at a time: a link a rank left in code/ is never written through."""
    workdir, run_dir = request["workdir"], request["run_dir"]   # real paths (dispatch's guard)
    store = os.path.join(workdir, ".nodectl", "objects")
    os.close(walk(run_dir, create=True))
    os.chmod(run_dir, 0o700)
    if request.get("new_attempt"):
        _archive_attempt(run_dir)
    for name in layout.FOLDERS:
        os.close(walk(os.path.join(run_dir, name), create=True))
    for entry in request["files"]:
        parts = [p for p in str(entry["path"]).split("/") if p not in ("", ".")]
        if not parts or ".." in parts or str(entry["path"]).startswith("/"):
            raise ValueError(f"path {entry['path']!r} leaves the run folder")
        folder = walk(os.path.join(run_dir, *parts[:-1]), create=True)
        try:
            mode = 0o700 if entry.get("mode", 0) & 0o111 else 0o600
            place_file(os.path.join(store, entry["sha256"]), folder, parts[-1], mode)
        finally:
            os.close(folder)
    for name, spec in request["rendered"].items():
        write_file(os.path.join(run_dir, name), spec["text"], spec["mode"])
    synced = sorted(e["path"][len("code/"):] for e in request["files"] if e["path"].startswith("code/"))
    write_file(os.path.join(run_dir, SYNCED_CODE), json.dumps(synced), 0o600)
    return {"run_dir": run_dir, "files": len(request["files"])}


SYNCED_CODE = "lib/synced-code.json"   # what `prepare` put in code/: what `pack` leaves there (the user's project)




def _archive_attempt(run_dir: str) -> None:
    """A resumed run keeps its folder (and output/ with the checkpoints); the last attempt's logs and state move
    to attempts/<n>/. Refused while any process of the run still lives."""
    if run_processes(run_dir):
        raise RuntimeError("the run is still running here; `nodectl stop --run RUN` first")
    if not os.path.exists(os.path.join(run_dir, layout.PGID)):
        return
    number = len(os.listdir(os.path.join(run_dir, "attempts"))) if os.path.isdir(os.path.join(run_dir, "attempts")) else 0
    target = os.path.join(run_dir, "attempts", str(number))
    os.makedirs(target)
    for name in layout.PER_ATTEMPT:
        if os.path.exists(os.path.join(run_dir, name)):
            os.replace(os.path.join(run_dir, name), os.path.join(target, name))
