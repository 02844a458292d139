"""The command line: a command name and a JSON request on stdin (or framed before a stream), one JSON answer."""
from __future__ import annotations

import importlib
import json
import os
import sys

from runctl.common import NotARun, Unsafe, no_run, trusted_path, trusted_run_dir
from verbs import VERBS   # beside runctl/ in the artifact: the one table of verbs


def _workdir_of(path: str, depth: int) -> str:
    for _ in range(depth):
        path = os.path.dirname(path)
    return path


def _under_workdir(*below: str):
    """argv[0] is that folder of a workdir (<workdir>/.nodectl/...): trusted, and the workdir handed on."""
    def guard(args: list, request: dict) -> None:
        args[0] = _workdir_of(trusted_path(args[0], below), len(below))
    return guard


def _prepare(args: list, request: dict) -> None:
    request["workdir"] = _workdir_of(trusted_path(request["workdir"], (".nodectl", "objects")), 2)
    request["run_dir"] = trusted_run_dir(request["run_dir"], create=True)


def _store(args: list, request: dict) -> None:
    _under_workdir(".nodectl", "objects")(args, request)
    if isinstance(request.get("prepare"), dict):   # the run folder, in the same call
        _prepare([], request["prepare"])


def _run(args: list, request: dict) -> None:
    args[0] = trusted_run_dir(args[0])


def _archive(args: list, request: dict) -> None:
    """The archive `pack` left: that file of a run folder, nothing else."""
    folder, archive = os.path.split(os.path.expanduser(args[0]))
    if archive not in (".collect.tar", ".collect.tar.gz"):
        raise NotARun(args[0])
    args[0] = os.path.join(trusted_run_dir(folder), archive)


# The trust rule a verb's declaration names (verbs.py), applied to the folders it is about to use before it uses
# them: the command gets their real paths (what it reaches below them is reached a name at a time, never through
# a link).
GUARDS = {"objects": _under_workdir(".nodectl", "objects"), "workdir": _under_workdir(".nodectl"),
          "envs": _under_workdir(".nodectl", "envs"), "store": _store, "prepare": _prepare, "run": _run,
          "archive": _archive, "none": lambda args, request: None}


def command(name: str):
    """The function that answers `name`: cmd_<name> of the module its declaration names."""
    verb = VERBS[name]
    return getattr(importlib.import_module(f"runctl.{verb.module}"), "cmd_" + name.lstrip("_"))


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
    if name not in VERBS:
        sys.stdout.write(json.dumps({"error": f"{name}: no such command (this runctl knows "
                                              f"{', '.join(v for v in sorted(VERBS) if not VERBS[v].internal)})"}) + "\n")
        return
    try:
        if VERBS[name].stream:   # reads its stdin itself, after the request
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
        GUARDS[VERBS[name].guard](args, request)
        answer = command(name)(args, request)
    except Unsafe as exc:
        answer = {"error": str(exc), "unsafe": {"path": exc.path, "why": exc.why}}
    except NotARun as exc:
        answer = no_run(str(exc), " (not a run folder: <workdir>/runs/<run id>[/<node>])")
    except Exception as exc:  # reported to the controller, which shows it with the node's name
        answer = {"error": f"{name}: {exc.__class__.__name__}: {exc}"}
    sys.stdout.write(json.dumps(answer) + "\n")
