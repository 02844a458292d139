"""Run folders: laid out from the store (prepare), an earlier attempt archived."""
from __future__ import annotations

import json
import os
import shutil

import runlayout as layout
from runctl.common import write_file
from runctl.processes import run_processes


def place_file(source: str, target: str, mode: int) -> None:
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
    for name in layout.FOLDERS:
        os.makedirs(os.path.join(run_dir, name), exist_ok=True)
    real_run_dir = os.path.realpath(run_dir)  # the workdir may be reached through a symlink
    for entry in request["files"]:
        target = os.path.join(run_dir, entry["path"])
        if os.path.commonpath([real_run_dir, os.path.realpath(target)]) != real_run_dir:
            raise ValueError(f"path {entry['path']!r} leaves the run folder")
        os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
        mode = 0o700 if entry.get("mode", 0) & 0o111 else 0o600
        place_file(os.path.join(store, entry["sha256"]), target, mode)
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
