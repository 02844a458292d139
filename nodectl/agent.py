"""Calling launchers/runctl.py on a node: installed once per version under <workdir>/.nodectl/, then called
with argv and a JSON request on stdin, answering one JSON document."""
from __future__ import annotations

import hashlib
import json
import shlex
from functools import lru_cache

from nodectl.resources import resource_dir
from nodectl.transport import Transport, quote_path

AGENT_TIMEOUT = 120.0


class AgentError(Exception):
    """runctl answered with an error, or not with JSON."""


@lru_cache(maxsize=1)
def _runctl() -> tuple[str, str]:
    source = (resource_dir("launchers") / "runctl.py").read_text(encoding="utf-8")
    return source, hashlib.sha256(source.encode()).hexdigest()[:16]


def agent_path(workdir: str) -> str:
    return f"{workdir.rstrip('/')}/.nodectl/runctl-{_runctl()[1]}.py"


def call(transport: Transport, command: str, *args: str, request: dict | None = None,
         timeout: float = AGENT_TIMEOUT) -> dict:
    """Run one runctl subcommand on the node, installing runctl first if this version is not there yet."""
    node = transport.node
    path = agent_path(node.workdir)
    body = json.dumps(request or {})
    invocation = " ".join([quote_path(node.python), quote_path(path), shlex.quote(command),
                           *(quote_path(a) if a.startswith("~") else shlex.quote(a) for a in args)])
    source = _runctl()[0]
    # Usually one round trip. Only when this version of runctl is not on the node yet (the `test -f` fails with
    # no output) does a second command install it from stdin, and a third repeat the call.
    result = transport.run(f"test -f {quote_path(path)} && {invocation}", stdin=body, timeout=timeout)
    if result.exit_code == 1 and not result.stdout.strip():
        install = (f"mkdir -p {quote_path(path.rsplit('/', 1)[0])} && cat > {quote_path(path)}.tmp && "
                   f"mv {quote_path(path)}.tmp {quote_path(path)}")
        installed = transport.run(install, stdin=source, timeout=timeout)
        if not installed.ok:
            raise AgentError(f"cannot install runctl on {node.name}: {installed.tail(5)}")
        result = transport.run(invocation, stdin=body, timeout=timeout)
    try:
        answer = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise AgentError(f"`{command}` on {node.name} exited {result.exit_code}: "
                         f"{result.tail(8) or 'no output'}") from None
    if isinstance(answer, dict) and answer.get("error"):
        raise AgentError(f"{node.name}: {answer['error']}")
    return answer
