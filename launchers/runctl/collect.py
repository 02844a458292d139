"""What leaves or reaches a run folder after the fact: pack (collect), fill (node 0's outputs), pull (the bucket)."""
from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import tarfile

import runlayout as layout
from runctl.common import quiet, read_json
from nodeio import last_json
from runctl.runfolder import SYNCED_CODE
from runctl.store import STREAM_BUFFER


def cmd_pack(args: list, request: dict) -> dict:
    """A tar.gz of the run's results (not code/ or lib/, not env.sh or launch.sh, which hold the real secrets;
    the controller keeps their redacted copies) for `collect` to fetch, plus the run-relative paths in
    request["also"] (a script's `--output_dir out` lands in code/out). Files that vanish while it is packed (a
    checkpoint rotating out) are counted, not an error; what is neither a file, a folder nor a link to a sibling
    (a fifo, a socket, a device, a link out of the run) is left out and counted."""
    run_dir = os.path.expanduser(args[0])
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
    return {"archive": target, "entries": packed["count"], "vanished": packed["vanished"],
            "skipped": packed["skipped"][:50], "missing": packed["missing"], "bytes": os.path.getsize(target),
            "code_written": len(packed["code"]), "code_examples": packed["code"][:5], "code_left": len(synced)}


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
    with tarfile.open(target, "w" if only else "w:gz") as tar:
        for folder, dirs, names in os.walk(run_dir):
            relative = os.path.relpath(folder, run_dir)
            if relative == ".":
                dirs[:] = [d for d in dirs if d != "lib" and (not only or d in only) and (d != "code" or synced)]
                names = [] if only else [n for n in names
                                         if n not in layout.SECRET_FILES and not n.startswith(".collect")]
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
    _check_caller()




def _pack_also(tar, run_dir: str, also: str, packed: dict) -> None:
    """One more path inside the run folder (relative, no `..`, never the files that hold secrets)."""
    parts = [p for p in str(also).split("/") if p not in ("", ".")]
    if not parts or ".." in parts or str(also).startswith("/") or parts[-1] in layout.SECRET_FILES:
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
        _check_caller()
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
    if os.path.exists(path):
        os.unlink(path)
    return {}
