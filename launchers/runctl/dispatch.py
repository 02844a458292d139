"""The command line: a command name and a JSON request on stdin (or framed before a stream), one JSON answer."""
from __future__ import annotations

import json
import os
import sys

from runctl.collect import cmd_cleanup, cmd_fill, cmd_pack, cmd_pull
from runctl.common import NotARun, Unsafe, no_run, trusted_path, trusted_run_dir
from runctl.containers import cmd_container
from runctl.diagnose import cmd_diagnose, cmd_stacks
from runctl.envs import cmd_env_build, cmd_env_status
from runctl.net import cmd_connect, cmd_listen, cmd_port, cmd_route, cmd_serve, cmd_unlisten
from runctl.runfolder import cmd_prepare
from runctl.start import cmd_start
from runctl.stop import cmd_stop
from runctl.store import cmd_have, cmd_identity, cmd_receive
from runctl.watch import cmd_poll, cmd_tail


def _guard(name: str, args: list, request: dict) -> None:
    """Apply the trust rule to the folders `name` is about to use, before it uses them, and hand the command their
    real paths (what it reaches below them is reached a name at a time, never through a link)."""
    if name in ("have", "receive"):
        args[0] = _workdir_of(trusted_path(args[0], (".nodectl", "objects")), 2)
        if name == "receive" and isinstance(request.get("prepare"), dict):   # the run folder, in the same call
            _guard("prepare", [], request["prepare"])
    elif name == "prepare":
        request["workdir"] = _workdir_of(trusted_path(request["workdir"], (".nodectl", "objects")), 2)
        request["run_dir"] = trusted_run_dir(request["run_dir"], create=True)
    elif name in ("identity", "env_status"):
        args[0] = _workdir_of(trusted_path(args[0], (".nodectl",)), 1)
    elif name == "env_build":
        args[0] = _workdir_of(trusted_path(args[0], (".nodectl", "envs")), 2)
    elif name in ("start", "poll", "tail", "stop", "stacks", "diagnose", "pack", "fill", "pull"):
        args[0] = trusted_run_dir(args[0])
    elif name == "cleanup":   # the archive `pack` left: that file of a run folder, nothing else
        folder, archive = os.path.split(os.path.expanduser(args[0]))
        if archive not in (".collect.tar", ".collect.tar.gz"):
            raise NotARun(args[0])
        args[0] = os.path.join(trusted_run_dir(folder), archive)


def _workdir_of(path: str, depth: int) -> str:
    for _ in range(depth):
        path = os.path.dirname(path)
    return path


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
        answer = no_run(str(exc), " (not a run folder: <workdir>/runs/<run id>[/<node>])")
    except Exception as exc:  # reported to the controller, which shows it with the node's name
        answer = {"error": f"{name}: {exc.__class__.__name__}: {exc}"}
    sys.stdout.write(json.dumps(answer) + "\n")
