"""Working on many nodes at once: `Cluster.fan_out` runs a function for every node in parallel with a bound and
returns one `NodeResult` per node instead of stopping at the first failure, as a `FanOut` with fabric GroupResult's
`succeeded` and `failed`; no exception escapes it. A `Session` holds one command's connections: each node's is opened lazily and reused by every step.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Generic, Iterable, TypeVar

from nodectl.inventory import Node
from nodectl.progress import Progress, no_progress
from nodectl.transport.channels import (CommandTimeout, NodeError, NodeErrorKind, Transport, TransportOptions, Unreachable,
                                        make_transport)

T = TypeVar("T")


@dataclass(frozen=True)
class NodeFailure:
    """Why one node gave no value, as one type (invoke's UnexpectedExit, per node). `kind`: unreachable (connect,
    authentication, host key, a dropped connection), timeout (the command outlived its limit), and NodeError's
    answered, exited, malformed, no_run (the node has no such run: never prepared there, or removed), unsafe;
    internal for a bug of nodectl's."""

    kind: NodeErrorKind
    message: str
    command: str | None = None
    exit_code: int | None = None
    last_lines: str = ""
    refused: bool = False   # unreachable because the node's SSH port refused or reset the connection: certain

    @property
    def unreachable(self) -> bool:
        return self.kind == NodeErrorKind.UNREACHABLE


def failure_of(exc: BaseException) -> NodeFailure:
    """The one reading of an exception raised by one node's work."""
    if isinstance(exc, Unreachable):
        return NodeFailure(NodeErrorKind.UNREACHABLE, str(exc), refused=exc.refused)
    if isinstance(exc, CommandTimeout):
        return NodeFailure(NodeErrorKind.TIMEOUT, str(exc) or "the command timed out")
    if isinstance(exc, NodeError):
        return NodeFailure(exc.kind, str(exc), exc.command, exc.exit_code, exc.last_lines)
    return NodeFailure(NodeErrorKind.INTERNAL, f"{exc.__class__.__name__}: {exc}")


@dataclass
class NodeResult(Generic[T]):
    """The outcome of one node's share of a fan-out: a value, or why there is none (`failure`, one field; `error`
    and `unreachable` read it)."""

    node: Node
    value: T | None = None
    failure: NodeFailure | None = None

    @classmethod
    def failed(cls, node: Node, message: str, kind: NodeErrorKind = NodeErrorKind.ANSWERED) -> "NodeResult":
        return cls(node, failure=NodeFailure(kind, message))

    @property
    def error(self) -> str | None:
        return self.failure.message if self.failure is not None else None

    @property
    def unreachable(self) -> bool:
        return self.failure is not None and self.failure.unreachable

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def no_run(self) -> bool:
        """The node answered that it has no such run (NoRun): not started there, as opposed to lost."""
        return self.failure is not None and self.failure.kind == NodeErrorKind.NO_RUN

    @property
    def reason(self) -> str:
        """The error without the node's own name in front (for a message that names the node itself)."""
        error = self.error or ""
        return error[len(self.node.name) + 2:] if error.startswith(f"{self.node.name}: ") else error

    @property
    def said(self) -> str:
        """The error with the node's name in front once (most messages from a node already start with it)."""
        error = self.error or ""
        return error if error.startswith(f"{self.node.name}: ") else f"{self.node.name}: {error}"


class FanOut(list[NodeResult[T]]):
    """A fan-out's results, one per node in node order (a list), with fabric GroupResult's two views: `succeeded`
    (each node's value by name) and `failed` (the results that carry a failure), so no caller filters `ok` by hand."""

    @property
    def succeeded(self) -> dict[str, T]:
        return {r.node.name: r.value for r in self if r.ok}

    @property
    def failed(self) -> list[NodeResult[T]]:
        return [r for r in self if not r.ok]

    def by_node(self) -> dict[str, NodeResult[T]]:
        return {r.node.name: r for r in self}


def _connection_key(node: Node) -> tuple:
    """What a transport's connection depends on; the rest of a node's settings (its python, env:) may change
    between a command's steps (a built venv) over the same connection."""
    return node.name, node.is_local, node.host, node.port, node.user, node.identity_file, node.workdir


class Cluster:
    """Transports for a set of nodes, opened lazily and reused until `close`. Made by a Session, it borrows the
    session's transports (the session closes them)."""

    def __init__(self, nodes: Iterable[Node], options: TransportOptions | None = None,
                 pool: dict[tuple, Transport] | None = None) -> None:
        self.options = options or TransportOptions()
        self.nodes = tuple(nodes)
        self.borrowed = pool is not None
        pool = {} if pool is None else pool
        self.transports = {}
        for node in self.nodes:
            key = _connection_key(node)
            if key not in pool:
                pool[key] = make_transport(node, self.options)
            transport = pool[key]
            transport.node = node   # this step's settings of the node, over the session's connection
            self.transports[node.name] = transport

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def transport(self, node: Node) -> Transport:
        return self.transports[node.name]

    def fan_out(self, work: Callable[[Transport], T], nodes: Iterable[Node] | None = None,
                on_done: Callable[[NodeResult[T]], None] | None = None,
                abandon_on_interrupt: bool = False) -> FanOut[T]:
        """Run `work` for every node in parallel (at most `fanout` at once); results in node order.

        On Ctrl-C, work not yet begun is cancelled and the calls in flight are waited for, so that no node is
        touched after the caller goes on to clean up; with `abandon_on_interrupt` (work that is itself a clean-up,
        such as a stop) they are left to finish in their threads and the interrupt is raised at once."""
        targets = tuple(nodes) if nodes is not None else self.nodes

        def one(node: Node) -> NodeResult[T]:
            try:
                result = NodeResult(node, value=work(self.transports[node.name]))
            except Exception as exc:  # one node's surprise must not take the others' results with it
                result = NodeResult(node, failure=failure_of(exc))
            if on_done:
                on_done(result)
            return result

        if not targets:
            return FanOut()
        pool = ThreadPoolExecutor(max_workers=max(1, min(self.options.fanout, len(targets))))
        try:
            results = FanOut(pool.map(one, targets))
        except KeyboardInterrupt:
            pool.shutdown(wait=not abandon_on_interrupt, cancel_futures=True)
            raise
        pool.shutdown()
        return results

    def close(self) -> None:
        """Close every connection at once (a session's are closed with the session)."""
        if not self.borrowed:
            close_all(self.transports.values(), self.options.fanout)


class Session:
    """One set of connections for one command, and its progress display: each step asks for the nodes it works on
    (`cluster(nodes)`), and a node's connection is opened the first time a step needs it and reused by every later
    step, also when a step changed the node's settings (a built venv's python)."""

    def __init__(self, options: TransportOptions | None = None, progress: Progress = no_progress) -> None:
        self.options = options or TransportOptions()
        self.progress = progress
        self._pool: dict[tuple, Transport] = {}

    def cluster(self, nodes: Iterable[Node]) -> Cluster:
        return Cluster(nodes, self.options, self._pool)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        close_all(self._pool.values(), self.options.fanout)
        self._pool.clear()


def close_all(transports: Iterable[Transport], fanout: int) -> None:
    """Close connections at once: paramiko joins each transport's thread, which waits out its 0.1 s socket poll,
    so closing 32 one after another took 2 s."""
    transports = list(transports)

    def close_one(transport: Transport) -> None:
        try:
            transport.close()
        except Exception:  # closing a dead connection must not mask the real outcome
            pass

    if len(transports) > 1:
        with ThreadPoolExecutor(max_workers=min(fanout, len(transports))) as pool:
            list(pool.map(close_one, transports))
    else:
        for transport in transports:
            close_one(transport)
