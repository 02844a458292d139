"""Building the locked environments on the nodes (nodectl/environment.py says what and why): ask each node for
its interpreter, platform and venv, fetch the wheels once per lock and platform, send what a node lacks through
the object store, and have every node build (or reuse) its venv in parallel."""
from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from nodectl.environment import BUILD_TIMEOUT, WheelSet, fetch_wheels
from nodectl.errors import NodectlError, UnreachableError
from nodectl.remote import sync
from nodectl.remote.answers import EnvAnswer
from nodectl.transport import Cluster, NodeResult, Transport
from nodectl.remote.client import NodeClient


def _sync_file(path: Path) -> sync.SyncFile:
    return sync.SyncFile(path=f"wheels/{path.name}", source=path, sha256=_hash(path), mode=0o644,
                         size=path.stat().st_size)


_HASHES: dict[tuple[str, int, int], str] = {}


def _hash(path: Path) -> str:
    info = path.stat()
    ident = (str(path), info.st_size, info.st_mtime_ns)
    if ident not in _HASHES:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        _HASHES[ident] = digest.hexdigest()
    return _HASHES[ident]


# --- the nodes' side, driven from here ---------------------------------------------------------------------------

def status(transport: Transport) -> EnvAnswer:
    return NodeClient(transport).env_status(transport.node.environment.lock_sha)


@dataclass(frozen=True)
class Provisioned:
    inventory: Any                       # the nodes' python: now their venvs
    answers: Mapping[str, EnvAnswer]     # per node: its venv as built or reused
    fetched: bool                        # wheels were downloaded (not all from the cache)
    sent: int = 0                        # bytes of wheels sent to the nodes (what their stores lacked)


def provision(cluster: Cluster, inventory, cancel: threading.Event | None = None,
              on_done: Callable[[NodeResult], None] | None = None) -> Provisioned:
    """Every node with an environment gets its venv (built, or reused as it is), in parallel; the inventory that
    comes back runs each such node's ranks with it. A node that cannot build it stops the launch: NodectlError
    (UnreachableError when it could not be reached) naming it."""
    nodes = [n for n in inventory.nodes if n.environment is not None]
    if not nodes:
        return Provisioned(inventory, {}, False)
    surveyed = cluster.fan_out(status, nodes)
    _raise_for(surveyed.failed, "could not be asked about its environment")
    found = surveyed.succeeded
    sets: dict[tuple, WheelSet] = {}
    sent: dict[str, int] = {}
    lock = threading.Lock()

    def wheels_for(node, answer: EnvAnswer) -> WheelSet:
        ident = (node.environment.lock_sha, answer.implementation, answer.python, answer.machine, answer.libc,
                 answer.libc_version)
        with lock:   # one resolve per lock and platform, whichever node asks first
            if ident not in sets:
                sets[ident] = fetch_wheels(node.environment, answer)
            return sets[ident]

    def build(transport: Transport) -> EnvAnswer:
        node, answer = transport.node, found[transport.node.name]
        if answer.present and answer.intact:
            return replace(answer, reused=True)
        request: dict[str, Any] = {"lock_sha": node.environment.lock_sha}
        if node.environment.install == "index":
            request.update(index=node.environment.index_url or "default", requirements=node.environment.requirements)
        else:
            wheel_set = wheels_for(node, answer)
            files = [_sync_file(p) for p in wheel_set.wheels + ((wheel_set.uv,) if wheel_set.uv else ())]
            sent[node.name] = sync.upload_missing(transport, files, cancel)
            request["wheels"] = [{"name": f.source.name, "sha256": f.sha256} for f in files[:len(wheel_set.wheels)]]
            if wheel_set.uv:
                request["uv"] = {"name": wheel_set.uv.name, "sha256": files[-1].sha256}
        return NodeClient(transport).env_build(request, timeout=BUILD_TIMEOUT)

    built = cluster.fan_out(build, nodes, on_done=on_done)
    _raise_for(built.failed, "could not build its environment")
    answers = built.succeeded
    venvs = tuple(replace(n, python=answers[n.name].python_path) if n.name in answers else n for n in inventory.nodes)
    return Provisioned(replace(inventory, nodes=venvs), answers, any(s.fetched for s in sets.values()),
                       sum(sent.values()))


def _raise_for(failed: list[NodeResult], what: str) -> None:
    if not failed:
        return
    detail = "; ".join(r.said for r in failed)
    if any(r.unreachable for r in failed):
        raise UnreachableError(detail)
    raise NodectlError(f"{', '.join(r.node.name for r in failed)} {what}: {detail}")




def use_built(cluster: Cluster, inventory):
    """The inventory with each node whose venv is built and unchanged running it (preflight and env-dump judge
    what the ranks will run); the others keep their python, and the probe reports why."""
    nodes = [n for n in inventory.nodes if n.environment is not None and n.environment.lock_sha]
    if not nodes:
        return inventory
    found = cluster.fan_out(status, nodes).succeeded
    ready = {name: a.python_path for name, a in found.items() if a.present and a.intact}
    return replace(inventory, nodes=tuple(replace(n, python=ready[n.name]) if n.name in ready else n
                                          for n in inventory.nodes))
