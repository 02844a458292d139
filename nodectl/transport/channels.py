"""One node's channel: fabric/paramiko for SSH nodes, subprocess for `transport: local` nodes. Commands run under
/bin/sh whatever the login shell, and files travel over the exec channel, so an sshd without the sftp subsystem is
enough. Host keys follow docs/REFERENCE.md §1 (ssh.py). Quoting for the shell lives here too (`quote_path`).
"""
from __future__ import annotations

import base64
import os
import select
import shlex
import shutil
import subprocess
import threading
import time
from enum import Enum
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import nodectl.transport.ssh as ssh
from nodectl.inventory import Node

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


class NodeErrorKind(str, Enum):
    """Why a node gave no value (NodeError's and NodeFailure's `kind`), equal to its name as answers spell it."""
    UNREACHABLE = "unreachable"   # connect, authentication, host key, a dropped connection
    TIMEOUT = "timeout"           # the command outlived its limit
    ANSWERED = "answered"         # a node-side helper said why it could not
    EXITED = "exited"             # it ended without answering
    MALFORMED = "malformed"       # its answer is not what the command answers
    NO_RUN = "no_run"             # the node has no such run (never prepared there, or removed)
    UNSAFE = "unsafe"             # a folder the node-side trust rule refused
    INTERNAL = "internal"         # a bug of nodectl's

    def __str__(self) -> str:
        return self.value


class NodeError(Exception):
    """A node-side failure whose message is already written for the user (it names the node). `kind`: "answered"
    (a node-side helper said why it could not), "exited" (it ended without answering), "malformed" (its answer is
    not what the command answers); with the command, its exit code and last lines where there are."""

    def __init__(self, message: str, *, kind: NodeErrorKind = NodeErrorKind.ANSWERED, command: str | None = None,
                 exit_code: int | None = None, last_lines: str = "") -> None:
        super().__init__(message)
        self.kind, self.command, self.exit_code, self.last_lines = kind, command, exit_code, last_lines


class Unreachable(Exception):
    """The node could not be reached (connect, auth or host key); the message says what to do. `refused`: the
    node's SSH port refused or reset the TCP connection itself, which only a host that is up but has no sshd
    listening (down, rebooting, sshd killed) does: certain, unlike a time-out, which a busy path also gives."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class CommandTimeout(Exception):
    pass


STREAM_BLOCK = 1 << 20


class StreamSink:
    """Where a streamed command's stdin goes. `write` takes bytes; `send_file` copies `count` bytes of an open
    file from where it stands and returns how many it copied (fewer when the file ended early). `check`, when
    set by the producer, is called between blocks (a cancel raises from it)."""

    def __init__(self, write: Callable[[bytes], None]) -> None:
        self.write = write
        self.check: Callable[[], None] | None = None

    def send_file(self, handle, count: int) -> int:
        copied = 0
        while copied < count:
            self._check()
            block = handle.read(min(STREAM_BLOCK, count - copied))
            if not block:
                break
            self.write(block)
            copied += len(block)
        return copied

    def _check(self) -> None:
        if self.check is not None:
            self.check()


class _PipeSink(StreamSink):
    """Into a pipe: file contents go from the page cache to the pipe inside the kernel (sendfile), so the bytes
    never cross Python and the GIL is free while they move."""

    def __init__(self, fd: int, progress: Callable[[], None]) -> None:
        super().__init__(self._write)
        self.fd, self.progress = fd, progress
        try:
            import fcntl

            fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)  # fewer wake-ups of the reader
        except (ImportError, OSError):
            pass

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]
            self.progress()

    def send_file(self, handle, count: int) -> int:
        offset = start = handle.tell()
        while offset - start < count:
            self._check()
            try:
                moved = os.sendfile(self.fd, handle.fileno(), offset, min(STREAM_BLOCK, count - (offset - start)))
            except OSError as exc:
                if isinstance(exc, BrokenPipeError) or offset > start:
                    raise
                return super().send_file(handle, count)  # a file system without sendfile
            if moved == 0:
                break
            offset += moved
            self.progress()
        handle.seek(offset)
        return offset - start


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
    runctl_seen = False  # set by nodectl.remote.agent once runctl answered through this transport

    def run(self, argv: Sequence[str] | str, *, stdin: str | bytes | None = None,
            timeout: float | None = None) -> CommandResult:
        raise NotImplementedError

    def run_stream(self, argv: Sequence[str] | str, produce: Callable[[StreamSink], None], *,
                   timeout: float | None = None) -> CommandResult:
        """Run a command whose stdin `produce(sink)` writes block by block (nothing held whole in memory);
        `timeout` bounds each block's progress and the wait for the answer."""
        raise NotImplementedError

    def open_lines(self, argv: Sequence[str] | str, first: bytes = b"") -> "LineStream":
        """Start a long-lived command (`first` written to its stdin at once) whose stdout is read a line at a
        time and whose stdin stays open for more lines: the run's watcher on a node (nodectl/remote/poller.py)."""
        raise NotImplementedError

    def host_key(self) -> str | None:
        """The node's SSH host key as this connection verified it ("ssh-ed25519 SHA256:..."); None where there is
        none (a local node) or no connection yet. What a node says of itself can be forged; its host key cannot."""
        return None

    def knock(self, timeout: float) -> "Knock":
        return Knock.UNKNOWN

    def put(self, local: str | os.PathLike, remote: str) -> None:
        raise NotImplementedError

    def get(self, remote: str, local: str | os.PathLike, remove: bool = False) -> None:
        """Fetch a file; with `remove`, the node's copy is unlinked as soon as it is open for reading, so the
        controller killed mid-transfer (even by SIGKILL) leaves nothing of it on the node."""
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

    def run_stream(self, argv, produce, *, timeout=None) -> CommandResult:
        command = to_command(argv)
        limit = timeout or self.options.command_timeout
        proc = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=_home(), bufsize=0)
        try:
            try:
                produce(_PipeSink(proc.stdin.fileno(), lambda: None))
            except BrokenPipeError:
                pass  # the command ended before reading everything: its answer says why
            out, err = proc.communicate(timeout=limit)  # closes stdin: the end of the stream
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        return CommandResult(command, proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"))

    def open_lines(self, argv, first: bytes = b"") -> "LineStream":
        proc = subprocess.Popen(["/bin/sh", "-c", to_command(argv)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, cwd=_home(), bufsize=0, start_new_session=True)
        stream = _ProcessLines(proc)
        if first:
            stream.send(first)
        return stream

    def put(self, local, remote) -> None:
        target = Path(os.path.expanduser(remote))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local, target)

    def get(self, remote, local, remove=False) -> None:
        Path(local).parent.mkdir(parents=True, exist_ok=True)
        with open(os.path.expanduser(remote), "rb") as source, open(local, "wb") as target:
            if remove:
                os.unlink(os.path.expanduser(remote))
            shutil.copyfileobj(source, target, 1 << 20)


def _home() -> str:
    home = os.path.expanduser("~")
    return home if os.path.isdir(home) else "/"


class SSHTransport(Transport):
    """A fabric Connection with nodectl's host-key policy (ssh.py); ~/.ssh/config, ssh-agent and
    ProxyJump apply."""

    def __init__(self, node: Node, options: TransportOptions) -> None:
        self.node, self.options = node, options
        self._connection = None
        self._address: tuple[str, int] | None = None   # the SSH port reached directly (None: through a proxy)
        self._lock = threading.Lock()  # a poller thread and the main thread may both (re)connect

    def _connect(self):
        with self._lock:
            return self._connect_locked()

    def _connect_locked(self):
        if self._connection is not None and self._connection.is_connected:
            return self._connection
        conn = ssh.connection(self.node.host, user=self.node.user, port=self.node.port,
                              identity_file=self.node.identity_file, timeout=self.options.connect_timeout,
                              accept_new=self.options.accept_new_host_keys)
        try:
            conn.open()
        except Exception as exc:
            message = ssh.open_errors(conn, exc, self.options.connect_timeout)
            if message is None:
                raise
            raise Unreachable(message, refused=not conn.gateway and ssh.refused(exc)) from None
        self._connection = conn
        self._address = None if conn.gateway else (conn.host, int(conn.port or 22))
        return conn

    def open(self) -> None:
        self._connect()

    def _session(self, command: str):
        """An exec channel running `command` under /bin/sh, whatever the login shell (fish, csh, a noisy zsh)."""
        conn = self._connect()
        try:
            channel = conn.client.get_transport().open_session(timeout=self.options.connect_timeout)
            channel.exec_command(posix_shell(command))
            return channel
        except Exception as exc:
            raise self._lost(exc) from None

    def _lost(self, exc: Exception) -> Exception:
        import paramiko

        if isinstance(exc, (OSError, EOFError, AttributeError, paramiko.SSHException)):
            self._connection = None
            return Unreachable(f"connection to {self.node.host} lost: {exc or exc.__class__.__name__}")
        return exc

    def host_key(self) -> str | None:
        try:
            return ssh.fingerprint(self._connect().client.get_transport().get_remote_server_key())
        except Exception:   # a lost connection: the caller keys by the name alone
            return None

    def knock(self, timeout: float) -> Knock:
        """Whether the node's SSH port takes a TCP connection now, closed at once (the kernel answers it; nothing
        starts on the node). UNKNOWN through a proxy or before the first connection: what a proxy says of the
        node is the proxy's."""
        if self._address is None:
            return Knock.UNKNOWN
        return knock(*self._address, timeout)

    def open_lines(self, argv, first: bytes = b"") -> "LineStream":
        channel = self._session(to_command(argv))
        stream = _ChannelLines(channel, self._lost)
        if first:
            stream.send(first)
        return stream

    @contextmanager
    def _channel(self, command: str) -> Iterator:
        """An exec channel for one command; a broken connection becomes Unreachable, the channel is closed."""
        channel = self._session(command)
        try:
            yield channel
        except CommandTimeout:
            raise
        except Exception as exc:
            raise self._lost(exc) from None
        finally:
            channel.close()

    def run(self, argv, *, stdin=None, timeout=None) -> CommandResult:
        # Straight on the paramiko channel of fabric's connection: invoke's runner feeds a non-terminal
        # in_stream one byte per 10 ms, which turns a 12 KB probe into two minutes.
        command = to_command(argv)
        with self._channel(command) as channel:
            return CommandResult(command, *_exec(channel, command, stdin, timeout or self.options.command_timeout))

    def run_stream(self, argv, produce, *, timeout=None) -> CommandResult:
        """The stream goes through the system's OpenSSH client where there is one: its cipher runs in a process
        of its own, as pdcp's and scp's do, where paramiko's packets all queue on this process's one GIL (at 8
        nodes that was half the sync time). Where that client cannot connect (none installed, another version's
        options, a key only paramiko was given) the stream goes over the paramiko connection instead."""
        command = to_command(argv)
        limit = timeout or self.options.command_timeout
        client = self._system_ssh()
        if client is not None:
            result = _stream_through_process(client + [posix_shell(command)], command, produce, limit)
            if result is not None:
                return result
        return self._stream_over_channel(command, produce, limit)

    def _system_ssh(self) -> list[str] | None:
        """argv of the system ssh for this node, bound to what the paramiko connection checked: the same
        ssh_config and known_hosts (found through $HOME, which OpenSSH itself ignores), strict host keys, no
        prompts."""
        client = shutil.which("ssh")
        if client is None or os.environ.get("NODECTL_SYSTEM_SSH") == "0":
            return None
        conn = self._connect()
        return ssh.system_ssh_argv(client, conn, self.node.identity_file, self.options.connect_timeout)

    def _stream_over_channel(self, command: str, produce, limit: float) -> CommandResult:
        with self._channel(command) as channel:
            try:
                produce(StreamSink(lambda block: _send(channel, block, limit)))
            except (EOFError, OSError):
                if not channel.exit_status_ready():
                    raise
                # the command ended before reading everything: its own answer says why
                return CommandResult(command, *_finish(channel, limit))
            channel.shutdown_write()
            return CommandResult(command, *_finish(channel, limit))

    def put(self, local, remote) -> None:
        """Send a file over the exec channel (no sftp subsystem needed). It lands under a temporary name and is
        renamed only once all its bytes arrived, so a broken transfer never leaves a partial file in place."""
        size = os.path.getsize(local)
        target = quote_path(remote)
        partial = quote_path(f"{remote}.part{os.getpid()}")
        command = (f"mkdir -p \"$(dirname {target})\" && umask 077 && head -c {size} > {partial} && "
                   f"[ \"$(wc -c < {partial})\" -eq {size} ] && mv -f {partial} {target} || "
                   f"{{ rm -f {partial}; echo 'upload incomplete' >&2; exit 1; }}")
        with self._channel(command) as channel, open(local, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                _send(channel, block, self.options.command_timeout)
            channel.shutdown_write()
            code, _, err = _finish(channel, self.options.command_timeout)
        if code != 0:
            raise TransferError(f"sending {local} to {self.node.name}:{remote} failed (exit {code}): {err.strip()}")

    def get(self, remote, local, remove=False) -> None:
        """Fetch a file over the exec channel. Start-up files may print banners first, so the content follows
        a marker line that carries its size; a short read is an error, not a truncated file. With `remove`, the
        file is opened, then unlinked, then read from the open descriptor."""
        marker = f"NODECTL-FILE-{os.urandom(6).hex()}"
        source = quote_path(remote)
        opened = f"exec 3< {source} && rm -f {source} && " if remove else f"exec 3< {source} && "
        command = f"size=$(wc -c < {source}) && {opened}printf '%s %s\\n' {marker} \"$size\" && exec cat <&3"
        Path(local).parent.mkdir(parents=True, exist_ok=True)
        with self._channel(command) as channel:
            received, expected = _receive_file(channel, marker.encode(), local, self.options.command_timeout)
            code = channel.recv_exit_status()
        if expected is None or code != 0 or received != expected:
            Path(local).unlink(missing_ok=True)
            raise TransferError(f"fetching {self.node.name}:{remote} failed (exit {code}, {received} of "
                                f"{expected} bytes)")

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


def _exec(channel, command: str, stdin, limit: float) -> tuple[int, str, str]:
    """Send stdin to a started command, then collect stdout and stderr until it exits. A command may end
    without reading its stdin (runctl's "not installed yet" answer does): its channel then closes under the
    send, which is its answer, not a lost connection."""
    try:
        if stdin:
            channel.sendall(stdin.encode() if isinstance(stdin, str) else stdin)
        channel.shutdown_write()
    except (OSError, EOFError):
        if not channel.exit_status_ready():  # sshd sends the exit status before it closes the channel
            raise
    try:
        return _finish(channel, limit)
    except CommandTimeout:
        raise CommandTimeout(f"{command!r} did not finish within {limit:g}s") from None


SSH_FAILED = 255  # what ssh exits with when it, not the remote command, failed


def _stream_through_process(argv: list[str], command: str, produce, limit: float) -> CommandResult | None:
    """Run `argv` (an ssh client) with `produce` writing its stdin. None when ssh itself could not connect or
    run the command (the caller then uses another way); a stall of `limit` seconds is a CommandTimeout."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, bufsize=0)  # Ctrl-C reaches nodectl, which ends the stream
    progress = {"at": time.monotonic(), "stalled": False}
    done = threading.Event()

    def watchdog() -> None:  # a write to a node that stopped reading blocks: end it after `limit` seconds
        while not done.wait(1.0):
            if time.monotonic() - progress["at"] > limit:
                progress["stalled"] = True
                proc.kill()
                return

    def advanced() -> None:
        progress["at"] = time.monotonic()

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        try:
            produce(_PipeSink(proc.stdin.fileno(), advanced))
            proc.stdin.close()  # the end of the stream
        except BrokenPipeError:
            pass  # the command (or ssh) ended before reading everything: its answer, or its exit, says why
        finally:
            stdin, proc.stdin = proc.stdin, None  # communicate must not flush it again
            _close_quietly(stdin)
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        raise CommandTimeout(f"{command!r}: no answer within {limit:g}s") from None
    finally:
        done.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if progress["stalled"]:
        raise CommandTimeout(f"no progress sending for {limit:g}s")
    stdout = out.decode(errors="replace")
    if proc.returncode == SSH_FAILED and "{" not in stdout:
        return None
    return CommandResult(command, proc.returncode, stdout, err.decode(errors="replace"))


def _close_quietly(stream) -> None:
    try:
        stream.close()
    except OSError:  # a broken pipe's unflushed rest: the reader is gone anyway
        pass


def posix_shell(command: str) -> str:
    """`command` for sshd's `$SHELL -c`: run by /bin/sh whatever the login shell is. Single quotes survive sh,
    bash, zsh, fish and csh alike unless the text holds a backslash or a newline (fish and csh read those inside
    quotes); such a command travels base64-encoded."""
    if "\\" not in command and "\n" not in command:
        return f"exec /bin/sh -c {shlex.quote(command)}"
    encoded = base64.b64encode(command.encode()).decode()
    return f"exec /bin/sh -c 'eval \"$(printf %s {encoded} | base64 -d)\"'"


def _send(channel, data: bytes, stall: float) -> None:
    """sendall with a deadline for a peer that stops reading."""
    view, deadline = memoryview(data), time.monotonic() + stall
    while view:
        if channel.send_ready():
            sent = channel.send(view[:1 << 16])
            if sent <= 0:
                raise EOFError("channel closed while sending")
            view, deadline = view[sent:], time.monotonic() + stall
        elif channel.exit_status_ready() or channel.closed:
            raise EOFError("the node stopped reading")
        elif time.monotonic() > deadline:
            raise CommandTimeout(f"no progress sending for {stall:g}s")
        else:
            select.select([], [channel], [], 0.05)


OUTPUT_KEPT = 32 << 20   # per stream and command: what a node prints beyond this, its oldest part is dropped


def _keep_tail(buffer: bytearray) -> None:
    """A node that prints without end (a hostile one printed 1 GB before its JSON) costs bounded memory: the
    newest OUTPUT_KEPT bytes are kept, where the answer (the last JSON line) and the last lines are."""
    if len(buffer) > 2 * OUTPUT_KEPT:
        del buffer[:len(buffer) - OUTPUT_KEPT]


def _finish(channel, limit: float) -> tuple[int, str, str]:
    out, err = bytearray(), bytearray()
    deadline = time.monotonic() + limit
    while not (channel.exit_status_ready() and channel.eof_received
               and not channel.recv_ready() and not channel.recv_stderr_ready()):
        while channel.recv_ready():
            out += channel.recv(1 << 16)
            _keep_tail(out)
        while channel.recv_stderr_ready():
            err += channel.recv_stderr(1 << 16)
            _keep_tail(err)
        if channel.closed and not channel.eof_received and not channel.recv_ready() \
                and not channel.recv_stderr_ready():   # the connection went (or was closed) under the command
            raise EOFError("the connection closed before the command ended")
        if time.monotonic() > deadline:
            raise CommandTimeout(f"no answer within {limit:g}s")
        select.select([channel], [], [], 0.05)
    del out[:max(0, len(out) - OUTPUT_KEPT)], err[:max(0, len(err) - OUTPUT_KEPT)]
    return channel.recv_exit_status(), out.decode(errors="replace"), err.decode(errors="replace")


def _receive_file(channel, marker: bytes, local, stall: float) -> tuple[int, int | None]:
    """Copy what follows the `marker SIZE` line into `local`; returns (bytes written, SIZE or None)."""
    head, expected, written = bytearray(), None, 0
    deadline = time.monotonic() + stall
    with open(local, "wb") as handle:
        while True:
            if channel.recv_ready():
                data, deadline = channel.recv(1 << 20), time.monotonic() + stall
                if expected is None:
                    head += data
                    at = head.find(marker + b" ")
                    end = head.find(b"\n", at) if at >= 0 else -1
                    if end < 0:
                        continue
                    expected, data = int(head[at + len(marker) + 1:end]), bytes(head[end + 1:])
                handle.write(data)
                written += len(data)
            elif channel.eof_received:
                if channel.recv_ready():   # the last data and the end arrived between the two checks above
                    continue
                return written, expected
            elif time.monotonic() > deadline:
                raise CommandTimeout(f"no data for {stall:g}s")
            else:
                _drain_stderr(channel, bytearray())   # a banner on stderr would make the select below spin
                select.select([channel], [], [], 0.05)


class Knock(str, Enum):
    """What a TCP connection to a node's SSH port found."""
    OPEN = "open"            # the node's kernel answered: the host is up
    REFUSED = "refused"      # refused or reset: up, and nothing listens there (sshd gone)
    SILENT = "silent"        # no answer within the time-out: down, cut off, or a path dropping packets
    UNKNOWN = "unknown"      # not asked: the node is reached through a proxy, or was never reached

    def __str__(self) -> str:
        return self.value


def knock(host: str, port: int, timeout: float) -> Knock:
    import socket

    try:
        with socket.create_connection((host, port), timeout=timeout):
            return Knock.OPEN
    except (ConnectionRefusedError, ConnectionResetError):
        return Knock.REFUSED
    except OSError:
        return Knock.SILENT


LINE_LIMIT = 16 << 20   # bytes of one line of a stream: a node that sends more without a newline is cut off


class LineStream:
    """A long-lived command: its stdout a line at a time, its stdin open for more. `readline` gives the next
    line (without its newline), None when none came within `timeout`, and raises EOFError once the command or
    the connection is gone (or a line outgrows LINE_LIMIT: a hostile node costs bounded memory)."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def readline(self, timeout: float) -> bytes | None:
        deadline = time.monotonic() + timeout
        while True:
            at = self.buffer.find(b"\n")
            if at >= 0:
                line = bytes(self.buffer[:at])
                del self.buffer[:at + 1]
                return line
            if len(self.buffer) > LINE_LIMIT:
                raise EOFError(f"a line of over {LINE_LIMIT >> 20} MiB without its end")
            data = self._receive(max(0.0, deadline - time.monotonic()))
            if data is None:
                return None
            if not data:
                raise EOFError("the stream ended")
            self.buffer += data

    def _receive(self, timeout: float) -> bytes | None:
        """What arrived within `timeout` (None: nothing yet), b"" at the end."""
        raise NotImplementedError

    def send(self, data: bytes) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> "LineStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


STDERR_KEPT = 4096   # a stream's last bytes of stderr (a login banner, the watcher's last words)


def _drain_stderr(channel, kept: bytearray) -> None:
    """Read what waits on the channel's stderr, keeping its last STDERR_KEPT bytes. paramiko's fileno() is
    readable while stdout or stderr holds data: stderr left unread (a login shell's banner) made every select on
    the channel return at once, and a reader waiting for stdout spun a core."""
    while channel.recv_stderr_ready():
        kept += channel.recv_stderr(1 << 16)
        del kept[:max(0, len(kept) - STDERR_KEPT)]


class _ChannelLines(LineStream):
    def __init__(self, channel, lost: Callable[[Exception], Exception]) -> None:
        super().__init__()
        self.channel, self.lost = channel, lost
        self.stderr = bytearray()

    def _receive(self, timeout: float) -> bytes | None:
        channel = self.channel
        try:
            _drain_stderr(channel, self.stderr)
            if not channel.recv_ready():
                if channel.closed or channel.eof_received:
                    return b""
                select.select([channel], [], [], timeout)
                _drain_stderr(channel, self.stderr)
                if not channel.recv_ready():
                    return b"" if channel.closed or channel.eof_received else None
            return channel.recv(1 << 16)
        except (OSError, EOFError) as exc:
            raise EOFError(str(self.lost(exc))) from None

    def send(self, data: bytes) -> None:
        try:
            _send(self.channel, data, 5.0)
        except (OSError, EOFError, CommandTimeout) as exc:
            raise EOFError(f"the stream stopped reading: {exc}") from None

    def close(self) -> None:
        self.channel.close()   # the node's watcher reads the end of its stdin and exits


class _ProcessLines(LineStream):
    def __init__(self, proc: subprocess.Popen) -> None:
        super().__init__()
        self.proc = proc

    def _receive(self, timeout: float) -> bytes | None:
        readable, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return os.read(self.proc.stdout.fileno(), 1 << 16) if readable else None

    def send(self, data: bytes) -> None:
        try:
            self.proc.stdin.write(data)
        except OSError as exc:
            raise EOFError(f"the stream stopped reading: {exc}") from None

    def close(self) -> None:
        _close_quietly(self.proc.stdin)
        try:
            self.proc.wait(2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        _close_quietly(self.proc.stdout)


class TransferError(NodeError):
    """A file did not arrive whole; nothing partial was left in its place."""


def make_transport(node: Node, options: TransportOptions) -> Transport:
    return LocalTransport(node, options) if node.is_local else SSHTransport(node, options)
