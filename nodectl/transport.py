"""Running commands on nodes: fabric/paramiko for SSH nodes, subprocess for `transport: local` nodes.

One connection per node is opened lazily and reused for all of a command's work. `fan_out` runs a function
for every node in parallel with a bound and returns one `NodeResult` per node instead of stopping at the first
failure (fabric's GroupResult). Host keys follow SPEC §1: known_hosts is checked, an unknown key is refused
unless `accept_new_host_keys` (then it is recorded, like ssh's accept-new), and a changed key is always refused.
"""
from __future__ import annotations

import os
import select
import shlex
import shutil
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generic, Iterable, Sequence, TypeVar

from nodectl.inventory import Node

T = TypeVar("T")
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_COMMAND_TIMEOUT = 120.0
DEFAULT_FANOUT = 64


@dataclass(frozen=True)
class TransportOptions:
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    command_timeout: float = DEFAULT_COMMAND_TIMEOUT
    fanout: int = DEFAULT_FANOUT
    accept_new_host_keys: bool = False


@dataclass(frozen=True)
class CommandResult:
    """What one command printed and how it ended on one node."""

    command: str
    exit_code: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def tail(self, lines: int = 20) -> str:
        return "\n".join((self.stdout + self.stderr).rstrip().splitlines()[-lines:])


class Unreachable(Exception):
    """The node could not be reached (connect, auth or host key); the message says what to do."""


class CommandTimeout(Exception):
    pass


def quote_path(path: str) -> str:
    """Quote a path for a POSIX shell while letting a leading '~/' expand to the node's home."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def to_command(argv: Sequence[str] | str) -> str:
    return argv if isinstance(argv, str) else shlex.join(argv)


class Transport:
    """The interface both transports share."""

    node: Node

    def run(self, argv: Sequence[str] | str, *, stdin: str | bytes | None = None,
            timeout: float | None = None) -> CommandResult:
        raise NotImplementedError

    def put(self, local: str | os.PathLike, remote: str) -> None:
        raise NotImplementedError

    def get(self, remote: str, local: str | os.PathLike) -> None:
        raise NotImplementedError

    def open(self) -> None:
        """Connect now (raises Unreachable); commands connect lazily otherwise."""

    def close(self) -> None:
        pass


class LocalTransport(Transport):
    """A node that is this machine: commands run through /bin/sh like sshd would run them."""

    def __init__(self, node: Node, options: TransportOptions) -> None:
        self.node, self.options = node, options

    def run(self, argv, *, stdin=None, timeout=None) -> CommandResult:
        command = to_command(argv)
        data = stdin.encode() if isinstance(stdin, str) else stdin
        try:
            proc = subprocess.run(["/bin/sh", "-c", command], input=data or b"", capture_output=True,
                                  timeout=timeout or self.options.command_timeout, cwd=_home())
        except subprocess.TimeoutExpired:
            raise CommandTimeout(f"{command!r} did not finish within {timeout or self.options.command_timeout}s")
        return CommandResult(command, proc.returncode, proc.stdout.decode(errors="replace"),
                             proc.stderr.decode(errors="replace"))

    def put(self, local, remote) -> None:
        target = Path(os.path.expanduser(remote))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local, target)

    def get(self, remote, local) -> None:
        Path(local).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(os.path.expanduser(remote), local)


def _home() -> str:
    home = os.path.expanduser("~")
    return home if os.path.isdir(home) else "/"


class SSHTransport(Transport):
    """A fabric Connection with nodectl's host-key policy; ~/.ssh/config, ssh-agent and ProxyJump apply."""

    _known_hosts_lock = threading.Lock()

    def __init__(self, node: Node, options: TransportOptions) -> None:
        self.node, self.options = node, options
        self._connection = None

    def _connect(self):
        if self._connection is not None and self._connection.is_connected:
            return self._connection
        import paramiko
        from fabric import Config, Connection

        connect_kwargs = {"key_filename": [os.path.expanduser(self.node.identity_file)]} \
            if self.node.identity_file else {}
        conn = Connection(self.node.host, user=self.node.user, port=self.node.port,
                          connect_timeout=int(max(1, self.options.connect_timeout)),
                          connect_kwargs=connect_kwargs, config=Config())
        known_hosts = Path(os.path.expanduser(
            (conn.ssh_config.get("userknownhostsfile") or "~/.ssh/known_hosts").split()[0]))
        client = conn.client
        for system_file in ("/etc/ssh/ssh_known_hosts",):
            if os.path.exists(system_file):
                client.load_system_host_keys(system_file)
        if known_hosts.exists():
            client.load_host_keys(str(known_hosts))
        client.set_missing_host_key_policy(
            _accept_new(known_hosts, self._known_hosts_lock) if self.options.accept_new_host_keys
            else _refuse_unknown())
        target = f"{conn.user}@{conn.host}:{conn.port}"
        try:
            conn.open()
        except _UnknownHostKey as exc:
            raise Unreachable(
                f"unknown host key for {exc.hostname} ({exc.fingerprint}); verify it and run again with "
                f"--accept-new-host-keys to record it in {known_hosts}") from None
        except paramiko.BadHostKeyException as exc:
            raise Unreachable(
                f"HOST KEY CHANGED for {exc.hostname}: expected {_fingerprint(exc.expected_key)}, got "
                f"{_fingerprint(exc.key)}. If the node was reinstalled, remove the old key with "
                f"`ssh-keygen -R {shlex.quote(exc.hostname)}` and connect again; otherwise do not connect") from None
        except paramiko.AuthenticationException as exc:
            raise Unreachable(f"authentication failed for {target} ({exc}); check identity_file, "
                              f"ssh-agent and the node's authorized_keys") from None
        except (socket.timeout, TimeoutError):
            raise Unreachable(f"connection to {target} timed out after {self.options.connect_timeout:g}s") from None
        except socket.gaierror as exc:
            raise Unreachable(f"cannot resolve {conn.host!r} ({exc.strerror})") from None
        except (OSError, paramiko.SSHException, EOFError) as exc:
            raise Unreachable(f"cannot connect to {target}: {exc}") from None
        self._connection = conn
        return conn

    def open(self) -> None:
        self._connect()

    def run(self, argv, *, stdin=None, timeout=None) -> CommandResult:
        # Straight on the paramiko channel of fabric's connection: invoke's runner feeds a non-terminal
        # in_stream one byte per 10 ms, which turns a 12 KB probe into two minutes.
        conn = self._connect()
        command = to_command(argv)
        limit = timeout or self.options.command_timeout
        try:
            channel = conn.client.get_transport().open_session(timeout=self.options.connect_timeout)
            try:
                return CommandResult(command, *_exec(channel, command, stdin, limit))
            finally:
                channel.close()
        except (OSError, EOFError, AttributeError) as exc:
            self._connection = None
            raise Unreachable(f"connection to {self.node.host} lost: {exc or exc.__class__.__name__}") from None
        except Exception as exc:
            import paramiko

            if isinstance(exc, paramiko.SSHException):
                self._connection = None
                raise Unreachable(f"connection to {self.node.host} lost: {exc}") from None
            raise

    def put(self, local, remote) -> None:
        self._connect().put(str(local), remote=_sftp_path(remote))

    def get(self, remote, local) -> None:
        Path(local).parent.mkdir(parents=True, exist_ok=True)
        self._connect().get(_sftp_path(remote), local=str(local))

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


def _exec(channel, command: str, stdin, limit: float) -> tuple[int, str, str]:
    """Run one command on an open channel: send stdin, then collect stdout and stderr until it exits."""
    channel.exec_command(command)
    if stdin:
        channel.sendall(stdin.encode() if isinstance(stdin, str) else stdin)
    channel.shutdown_write()
    out, err = bytearray(), bytearray()
    deadline = time.monotonic() + limit
    while True:
        while channel.recv_ready():
            out += channel.recv(1 << 16)
        while channel.recv_stderr_ready():
            err += channel.recv_stderr(1 << 16)
        if channel.exit_status_ready() and channel.eof_received \
                and not channel.recv_ready() and not channel.recv_stderr_ready():
            break
        if time.monotonic() > deadline:
            raise CommandTimeout(f"{command!r} did not finish within {limit:g}s")
        select.select([channel], [], [], 0.05)
    return channel.recv_exit_status(), out.decode(errors="replace"), err.decode(errors="replace")


def _sftp_path(path: str) -> str:
    """SFTP paths are relative to the login directory, so '~/x' becomes 'x'."""
    return path[2:] if path.startswith("~/") else path


def _fingerprint(key) -> str:
    return f"{key.get_name()} {key.fingerprint}" if hasattr(key, "fingerprint") else key.get_name()


class _UnknownHostKey(Exception):
    def __init__(self, hostname: str, key) -> None:
        super().__init__(hostname)
        self.hostname, self.fingerprint = hostname, _fingerprint(key)


def _refuse_unknown():
    import paramiko

    class RefuseUnknown(paramiko.MissingHostKeyPolicy):
        def missing_host_key(self, client, hostname, key):
            raise _UnknownHostKey(hostname, key)

    return RefuseUnknown()


def _accept_new(known_hosts: Path, lock: threading.Lock):
    """ssh's StrictHostKeyChecking=accept-new: record an unknown key; a changed key still fails in paramiko."""
    import paramiko

    class AcceptNew(paramiko.MissingHostKeyPolicy):
        def missing_host_key(self, client, hostname, key):
            client.get_host_keys().add(hostname, key.get_name(), key)
            with lock:
                known_hosts.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                with open(known_hosts, "a", encoding="ascii") as handle:
                    handle.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
                os.chmod(known_hosts, 0o600)

    return AcceptNew()


def make_transport(node: Node, options: TransportOptions) -> Transport:
    return LocalTransport(node, options) if node.is_local else SSHTransport(node, options)


@dataclass
class NodeResult(Generic[T]):
    """The outcome of one node's share of a fan-out: a value, or why there is none."""

    node: Node
    value: T | None = None
    error: str | None = None
    unreachable: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None


class Cluster:
    """Transports for a set of nodes, opened lazily and reused until `close`."""

    def __init__(self, nodes: Iterable[Node], options: TransportOptions | None = None) -> None:
        self.options = options or TransportOptions()
        self.nodes = tuple(nodes)
        self.transports = {node.name: make_transport(node, self.options) for node in self.nodes}

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def transport(self, node: Node) -> Transport:
        return self.transports[node.name]

    def fan_out(self, work: Callable[[Transport], T], nodes: Iterable[Node] | None = None,
                on_done: Callable[[NodeResult[T]], None] | None = None) -> list[NodeResult[T]]:
        """Run `work` for every node in parallel (at most `fanout` at once); results in node order."""
        targets = tuple(nodes) if nodes is not None else self.nodes

        def one(node: Node) -> NodeResult[T]:
            try:
                result = NodeResult(node, value=work(self.transports[node.name]))
            except Unreachable as exc:
                result = NodeResult(node, error=str(exc), unreachable=True)
            except CommandTimeout as exc:
                result = NodeResult(node, error=str(exc))
            if on_done:
                on_done(result)
            return result

        if not targets:
            return []
        with ThreadPoolExecutor(max_workers=max(1, min(self.options.fanout, len(targets)))) as pool:
            return list(pool.map(one, targets))

    def close(self) -> None:
        for transport in self.transports.values():
            try:
                transport.close()
            except Exception:  # closing a dead connection must not mask the real outcome
                pass
