"""Opening SSH connections the way docs/REFERENCE.md §1 asks: fabric for ~/.ssh/config, ssh-agent and ProxyJump, with every
host key on the path checked and every hop bound by the same timeouts.

fabric builds ProxyJump hops itself with paramiko's AutoAddPolicy (an unknown or even a wrong bastion key is
accepted) and without our connect timeout, and opens the forwarded channel with paramiko's default of an hour.
So nodectl builds the hop chain itself from the same ssh_config directive, gives each hop the host-key policy,
and opens forwarded channels with the connect timeout.

known_hosts is read line by line: `@revoked` keys are refused, `@cert-authority` lines are skipped (paramiko
cannot check host certificates, so such hosts are unknown unless also listed plainly), malformed lines are
ignored as ssh does.
"""
from __future__ import annotations

import functools
import os
import shlex
import socket
import threading
from pathlib import Path

DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"
SYSTEM_KNOWN_HOSTS = "/etc/ssh/ssh_known_hosts"
_known_hosts_lock = threading.Lock()


class HostKeyError(Exception):
    """A host key that must not be accepted; the message says what to do."""


def key_name(host: str, port: int | None) -> str:
    """How ssh names a host in known_hosts and in `ssh-keygen -R`: [host]:port unless the port is 22."""
    return host if port in (None, 22) else f"[{host}]:{port}"


def fingerprint(key) -> str:
    return f"{key.get_name()} {key.fingerprint}" if hasattr(key, "fingerprint") else key.get_name()


def load_known_hosts(client, paths: list[Path]) -> set[tuple[str, str]]:
    """Add every plain, unrevoked entry of `paths` to the client's host keys; return the revoked
    (type, base64) keys, which the policy refuses."""
    from paramiko.hostkeys import HostKeyEntry

    lines: list[str] = []
    for path in paths:
        try:
            lines += path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            continue
    lines = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    revoked = {(f[2], f[3]) for f in (line.split() for line in lines) if f[0] == "@revoked" and len(f) >= 4}
    keys = client.get_host_keys()
    for number, line in enumerate(lines, start=1):
        if line.startswith("@"):
            continue
        try:
            entry = HostKeyEntry.from_line(line, number)
        except Exception:  # a line paramiko cannot read is skipped, as ssh skips it
            continue
        if entry is None or entry.key is None or (entry.key.get_name(), entry.key.get_base64()) in revoked:
            continue
        for name in entry.hostnames:
            keys.add(name, entry.key.get_name(), entry.key)
    return revoked


def _policy(known_hosts: Path, accept_new: bool, revoked: set[tuple[str, str]]):
    import paramiko

    class Policy(paramiko.MissingHostKeyPolicy):
        """Unknown keys: refused, or recorded like ssh's accept-new. Revoked keys: always refused."""

        def missing_host_key(self, client, hostname, key):
            if (key.get_name(), key.get_base64()) in revoked:
                raise HostKeyError(f"the host key of {hostname} ({fingerprint(key)}) is marked @revoked in "
                                   f"known_hosts; do not connect")
            if not accept_new:
                raise HostKeyError(f"unknown host key for {hostname} ({fingerprint(key)}); verify it and run "
                                   f"again with --accept-new-host-keys to record it in {known_hosts}")
            client.get_host_keys().add(hostname, key.get_name(), key)
            with _known_hosts_lock:
                known_hosts.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                with open(known_hosts, "a", encoding="ascii") as handle:
                    handle.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
                os.chmod(known_hosts, 0o600)

    return Policy()


@functools.cache
def _detached_proxy_class():
    import shlex
    import subprocess

    from paramiko import ProxyCommand

    class DetachedProxyCommand(ProxyCommand):
        """paramiko's ProxyCommand, started in a session of its own: a Ctrl-C at the terminal goes to the whole
        foreground process group, and a proxy in it died with nodectl's first SIGINT, so the stop that follows could
        not reach the node (the run went on while nodectl said it had stopped it). nodectl ends it on close."""

        def __init__(self, command_line: str) -> None:
            self.cmd = shlex.split(command_line)
            self.process = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, bufsize=0, start_new_session=True)
            self.timeout = None

    return DetachedProxyCommand


def DetachedProxyCommand(command_line: str):  # noqa: N802 - a class, built on first use (paramiko loads lazily)
    return _detached_proxy_class()(command_line)


def _connection_class():
    from fabric import Connection

    class BoundedConnection(Connection):
        """A fabric Connection whose forwarded (ProxyJump) channel opens within the connect timeout, and whose
        ProxyCommand runs in a session of its own."""

        def open_gateway(self):
            if isinstance(self.gateway, str):
                from io import StringIO

                from paramiko import SSHConfig

                config = SSHConfig()   # as fabric does: a one-host config expands %h, %p, %r in the command
                config.parse(StringIO(f"Host {self.host}\n    ProxyCommand {self.gateway}"))
                return DetachedProxyCommand(config.lookup(self.host)["proxycommand"])
            self.gateway.open()
            return self.gateway.transport.open_channel(
                kind="direct-tcpip", dest_addr=(self.host, int(self.port)), src_addr=("", 0),
                timeout=self.connect_timeout)

    return BoundedConnection


AEAD_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")


def _aead_first_transport(sock, **kwargs):
    """A paramiko Transport that asks for AES-GCM first (the server's sshd has it by default since OpenSSH 6.2):
    one AES-NI pass per packet where paramiko's default, AES-CTR + HMAC-SHA2, costs two and builds an HMAC
    object per 32 KiB packet in Python. Other ciphers stay as the fallback, in paramiko's order."""
    from paramiko import Transport

    transport = Transport(sock, **kwargs)
    options = transport.get_security_options()
    first = tuple(c for c in AEAD_CIPHERS if c in options.ciphers)
    options.ciphers = first + tuple(c for c in options.ciphers if c not in first)
    return transport


def _secure(conn, timeout: float, accept_new: bool) -> None:
    """Host keys and timeouts for one hop."""
    known_hosts = Path(os.path.expanduser(
        (conn.ssh_config.get("userknownhostsfile") or DEFAULT_KNOWN_HOSTS).split()[0]))
    revoked = load_known_hosts(conn.client, [Path(SYSTEM_KNOWN_HOSTS), known_hosts])
    conn.client.set_missing_host_key_policy(_policy(known_hosts, accept_new, revoked))
    conn.connect_timeout = max(1, int(timeout))
    conn.connect_kwargs.update(banner_timeout=timeout, auth_timeout=timeout, transport_factory=_aead_first_transport)


def connection(host: str, *, user: str | None, port: int | None, identity_file: str | None, timeout: float,
               accept_new: bool):
    """An unopened fabric Connection to `host`: its ProxyJump hops (from ~/.ssh/config) built and secured, or its
    ProxyCommand run as the socket (ssh's rule: ProxyJump wins when both are set)."""
    from fabric import Config

    cls = _connection_class()
    kwargs = {"key_filename": [os.path.expanduser(identity_file)]} if identity_file else {}
    conn = cls(host, user=user, port=port, connect_timeout=max(1, int(timeout)), connect_kwargs=kwargs,
               config=Config(), gateway=False)
    _secure(conn, timeout, accept_new)
    gateway = None
    jump = conn.ssh_config.get("proxyjump")
    if jump and jump.lower() != "none":
        for hop in reversed(jump.split(",")):  # the last hop first: each earlier one is its gateway
            hop_conn = cls(hop, config=Config(), gateway=gateway or False, connect_timeout=max(1, int(timeout)))
            _secure(hop_conn, timeout, accept_new)
            gateway = hop_conn
        conn.gateway = gateway
    elif (command := conn.ssh_config.get("proxycommand")) and command.strip().lower() != "none":
        conn.gateway = command   # fabric runs it (paramiko.ProxyCommand): the target's stdio through it
    return conn


def ssh_hostname(host: str) -> str:
    """The address ssh connects to for `host`: its HostName in ~/.ssh/config (and /etc/ssh/ssh_config), tokens
    expanded, or `host` itself. What other nodes must reach too: an alias means nothing to their resolvers."""
    from fabric import Config
    from fabric.connection import Connection

    if ":" in host or host.startswith("["):   # an IPv6 address is no alias (and fabric would read :port into it)
        return host
    try:
        return Connection(host, config=Config()).host or host
    except Exception:  # noqa: BLE001 - an unreadable ssh config leaves the name as it was written
        return host


DEFAULT_IDENTITIES = ("id_rsa", "id_ecdsa", "id_ed25519")


def system_ssh_argv(client: str, conn, identity_file: str | None, timeout: float) -> list[str]:
    """The OpenSSH client's argv for the host `conn` reached, with the same settings that connection used:
    ssh_config and known_hosts under $HOME (OpenSSH reads the password database's home, which may differ),
    the inventory's identity or the default ones, strict host-key checking (paramiko checked the same file
    already), no prompts. AES-GCM first, as for paramiko; an OpenSSH too old for `^` fails here and the
    caller falls back to paramiko. The caller appends the remote command."""
    home = Path(os.path.expanduser("~"))
    config = home / ".ssh" / "config"
    known_hosts = os.path.expanduser((conn.ssh_config.get("userknownhostsfile") or DEFAULT_KNOWN_HOSTS).split()[0])
    argv = [client, "-F", str(config) if config.is_file() else "/dev/null", "-T", "-x",
            "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={known_hosts}",
            "-o", f"ConnectTimeout={max(1, int(timeout))}", "-o", "ServerAliveInterval=10",
            "-o", "ServerAliveCountMax=3", "-o", "ControlMaster=no", "-o", f"Ciphers=^{','.join(AEAD_CIPHERS)}"]
    identities = [identity_file] if identity_file else [str(home / ".ssh" / n) for n in DEFAULT_IDENTITIES]
    for identity in identities:
        path = os.path.expanduser(identity)
        if os.path.isfile(path):
            argv += ["-i", path]
    if conn.user:
        argv += ["-l", conn.user]
    if conn.port:
        argv += ["-p", str(conn.port)]
    # the name as written in the inventory: OpenSSH then applies the same Host block (HostName, ProxyJump,
    # ProxyCommand) that the paramiko connection did; the resolved HostName would bypass a bastion
    return argv + ["--", getattr(conn, "original_host", None) or conn.host]


def open_errors(conn, exc: BaseException, timeout: float) -> str | None:
    """The user's message for a failed open, or None if `exc` is not a connection problem."""
    import paramiko

    target = f"{conn.user}@{conn.host}:{conn.port}"
    via = "" if not conn.gateway else f" (through ProxyCommand {conn.gateway})" if isinstance(conn.gateway, str) \
        else f" (through ProxyJump {conn.ssh_config.get('proxyjump')})"
    if isinstance(exc, HostKeyError):
        return str(exc)
    if isinstance(exc, paramiko.BadHostKeyException):
        name = exc.hostname if exc.hostname.startswith("[") else key_name(exc.hostname, _port_of(conn, exc))
        return (f"HOST KEY CHANGED for {name}: expected {fingerprint(exc.expected_key)}, got {fingerprint(exc.key)}. "
                f"If the host was reinstalled, remove the old key with `ssh-keygen -R {shlex.quote(name)}` and "
                f"connect again; otherwise do not connect")
    if isinstance(exc, FileNotFoundError) and exc.filename:
        return (f"cannot log in to {target}{via}: the key file {exc.filename} does not exist; fix identity_file: in "
                f"hosts.yaml (or ~/.ssh/config's IdentityFile)")
    if isinstance(exc, paramiko.AuthenticationException) or (
            isinstance(exc, paramiko.SSHException) and any(
                words in str(exc) for words in ("No existing session", "No authentication methods available"))):
        return f"authentication failed for {target}{via} ({_reason(exc)}); tried {_keys_tried(conn)}; the public " \
               f"key must be in that user's ~/.ssh/authorized_keys on the node"
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        return (f"cannot connect to {target}{via}: connection refused (nothing listens on port {conn.port} there: "
                f"is sshd running, is port: right, does a firewall reject it?)")
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return f"connection to {target}{via} timed out after {timeout:g}s"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve {conn.host!r}{via} ({exc.strerror})"
    if isinstance(exc, UnicodeError):  # a label over 63 characters, from the idna codec
        return f"cannot resolve {conn.host!r}: not a valid host name ({exc})"
    if isinstance(exc, (OSError, paramiko.SSHException, EOFError)):
        return f"cannot connect to {target}{via}: {exc or exc.__class__.__name__}"
    return None


def refused(exc: BaseException) -> bool:
    """The node's own kernel turned the connection away (refused, or reset before sshd's banner): a host that is
    up with nothing listening on its SSH port. A time-out or a name that does not resolve is not this."""
    import paramiko

    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        return all(isinstance(e, ConnectionRefusedError) or getattr(e, "errno", None) == 111
                   for e in exc.errors.values())
    if isinstance(exc, (ConnectionRefusedError, ConnectionResetError)):
        return True
    return isinstance(exc, paramiko.SSHException) and "reset by peer" in str(exc)


def _port_of(conn, exc) -> int | None:
    """The port of the hop whose key changed: the target's, or a gateway's of that host name."""
    hop = conn
    while hop is not None and hop is not False:
        if hop.host == exc.hostname:
            return int(hop.port)
        hop = hop.gateway if not isinstance(hop.gateway, str) else None
    return int(conn.port)


def _reason(exc: BaseException) -> str:
    text = str(exc)
    if "No existing session" in text or "No authentication methods available" in text:
        return "no key was offered: none could be loaded"
    return text or exc.__class__.__name__


def _keys_tried(conn) -> str:
    """Where paramiko looked for a key: the identity file(s), the agent, the default ~/.ssh/id_* files."""
    files = conn.connect_kwargs.get("key_filename") or []
    files = [files] if isinstance(files, str) else list(files)
    shown = [f"{f}{'' if os.path.exists(os.path.expanduser(f)) else ' (missing)'}" for f in files]
    agent = "ssh-agent" if os.environ.get("SSH_AUTH_SOCK") else "no ssh-agent (SSH_AUTH_SOCK unset)"
    defaults = [p for p in ("~/.ssh/id_ed25519", "~/.ssh/id_ecdsa", "~/.ssh/id_rsa")
                if os.path.exists(os.path.expanduser(p))]
    return ", ".join(["identity_file " + ", ".join(shown) if shown else "no identity_file", agent,
                      ("default keys " + ", ".join(defaults)) if defaults else "no ~/.ssh/id_* key"])
