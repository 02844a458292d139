"""Real OpenSSH servers on loopback addresses, one per simulated node, that share nothing with the controller.

Each node's sshd runs in a mount namespace of its own (`unshare --mount`): the controller's /tmp, /var/tmp,
/root, /home, /work, /opt and the project folder are replaced by empty tmpfs mounts, so neither the project, nor
the runs folder, nor the controller's HOME (a throwaway folder here, the user's own ~/.ssh never takes part) can
be seen from a node. Only the node's Python is bound back in, at /opt/venv (plus the base interpreter that venv
points at). Each node has its own home, which the test reads from the host side through `SSHNode.host_path`.

A node can log in as a user of its own with its own login shell (sh, bash, zsh, fish), print banners from its
shell start-up files, lack the sftp subsystem, reach its workdir through a symlink, share its home with another
node (an NFS home), or live in a network namespace. Users are created once per machine (root only).
"""
from __future__ import annotations

import os
import pwd
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest
import yaml

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
PORT = 2222
NODE_PYTHON = "/opt/venv/bin/python"
REPO = Path(__file__).resolve().parents[2]
HIDDEN = ("/tmp", "/var/tmp", "/work", "/home", "/opt")
SHELLS = {"sh": "/bin/sh", "bash": "/bin/bash", "zsh": "/usr/bin/zsh", "fish": "/usr/bin/fish"}
# what a user's shell start-up files export on a noisy node: a secret of the node's, never of nodectl's to keep
LOGIN_SECRET = "node-login-secret-0c0ffee"
BANNER = "*** Welcome to {node}: authorised use only ***"


def sshd_available() -> bool:
    return os.path.exists(SSHD) and shutil.which("ssh-keygen") is not None and shutil.which("unshare") is not None


def isolation_available() -> bool:
    """Mount namespaces need root here (CI runs as root)."""
    if os.geteuid() != 0:
        return False
    return subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode == 0


def _keygen(path: Path, comment: str) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)], check=True)


def wait_port(address: str, port: int, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with socket.create_connection((address, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"sshd on {address}:{port} did not come up")


def host_keys(address: str, port: int, timeout: float = 10.0) -> list[str]:
    """The base64 host keys the SSH server at address:port shows (ssh-keyscan), [] when none answered."""
    argv = ["ssh-keyscan", "-T", "5", "-p", str(port), "-t", "ed25519", address]
    deadline = time.time() + timeout
    while True:
        scanned = subprocess.run(argv, capture_output=True, text=True)
        keys = [line.split()[2] for line in scanned.stdout.splitlines() if len(line.split()) >= 3]
        if keys or time.time() > deadline:
            return keys
        time.sleep(0.1)


def ensure_user(name: str, shell: str) -> pwd.struct_passwd:
    """A login user with this shell; '*' as password hash, so sshd (without PAM) does not call it locked.
    Serialised across pytest-xdist workers: useradd/usermod refuse to run while another holds /etc/passwd."""
    import fcntl

    with open("/tmp/nodectl-tests-users.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _ensure_user(name, shell)


def _ensure_user(name: str, shell: str) -> pwd.struct_passwd:
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "-M", "-d", f"/home/{name}", "-s", shell, name], check=True, capture_output=True)
        entry = pwd.getpwnam(name)
    if entry.pw_shell != shell:
        subprocess.run(["usermod", "-s", shell, name], check=True, capture_output=True)
    subprocess.run(["usermod", "-p", "*", name], check=True, capture_output=True)
    return pwd.getpwnam(name)


def loopback_prefix() -> str:
    """127.0.0. in a plain run; 127.<n>.0. in pytest-xdist worker gw<n>, so that workers' clusters (same octets,
    same port) never meet. All of 127/8 is this machine's loopback."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return f"127.{int(worker[2:]) if worker[2:].isdigit() else 0}.0."


@dataclass
class NodeSpec:
    """How one simulated node differs from a plain root login with bash."""

    user: str = "root"
    shell: str = "bash"              # login shell of a non-root user (root keeps the machine's)
    sftp: bool = True
    noisy: bool = False              # shell start-up files print a banner on stdout and stderr
    workdir_link: bool = False       # the inventory's workdir is a symlink to a folder elsewhere in the home
    share_home_with: int | None = None   # this node's home is that node's home (an NFS home)


@dataclass
class SSHNode:
    name: str
    address: str
    port: int
    root: Path                       # host-side folder of this node: keys, home, sshd.log
    spec: NodeSpec
    process: subprocess.Popen | None = None
    netns: str | None = None

    @property
    def home(self) -> str:
        """HOME as the node sees it."""
        return "/root" if self.spec.user == "root" else f"/home/{self.spec.user}"

    @property
    def home_dir(self) -> Path:
        """The same home, seen from the host (for tests that look at what landed on the node)."""
        return self.root / "home"

    @property
    def host_key(self) -> Path:
        return self.root / "ssh_host_ed25519_key"

    @property
    def workdir_setting(self) -> str:
        return "~/work-link" if self.spec.workdir_link else "~/nodectl"

    @property
    def workdir(self) -> Path:
        """The node's workdir, seen from the host."""
        return self.host_path(self.workdir_setting)

    def host_path(self, node_path: str) -> Path:
        """Where a path under the node's home lies on the host."""
        for prefix in ("~/", f"{self.home}/"):
            if node_path.startswith(prefix):
                return self.home_dir / node_path[len(prefix):]
        raise ValueError(f"{node_path} is not under {self.name}'s home")


@dataclass
class SSHCluster:
    root: Path
    count: int
    port: int = PORT
    first_octet: int = 2
    specs: dict[int, NodeSpec] = field(default_factory=dict)
    nodes: list[SSHNode] = field(default_factory=list)
    addresses: list[str] | None = None     # default: 127.<worker>.0.<first_octet + i>
    namespaces: list[str] | None = None    # run node i's sshd inside this network namespace
    names: list[str] | None = None

    @property
    def home(self) -> Path:
        """The controller's HOME in tests: ~/.ssh with the client key, known_hosts and config."""
        return self.root / "home"

    @property
    def identity(self) -> Path:
        return self.home / ".ssh" / "id_ed25519"

    def start(self) -> "SSHCluster":
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege-separation directory
        (self.home / ".ssh").mkdir(parents=True, mode=0o700)
        _keygen(self.identity, "nodectl-tests")
        try:
            for i in range(self.count):
                self.nodes.append(self._make_node(i))
            for node in self.nodes:
                node.process = self._sshd(node)
            for node in self.nodes:
                self._wait_up(node)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_up(self, node: SSHNode) -> None:
        """The port answers, and the server answering is this node's own: it shows this node's host key (another
        program's sshd, or one a crashed test left behind, on the same address would otherwise be talked to, and
        the test would fail later with a misleading "HOST KEY CHANGED")."""
        wait_port(node.address, node.port)
        if node.process.poll() is not None:
            raise RuntimeError(f"sshd of {node.name} exited: {(node.root / 'sshd.log').read_text()[-500:]}")
        mine = Path(f"{node.host_key}.pub").read_text().split()[1]
        shown = host_keys(node.address, node.port)
        if mine not in shown:
            raise RuntimeError(f"{node.address}:{node.port} is taken by another server (its host key is not "
                               f"{node.name}'s; {node.name}'s sshd said: "
                               f"{(node.root / 'sshd.log').read_text()[-300:].strip() or 'nothing'}): stop that "
                               f"program, or free the address, and run the tests again")

    def _make_node(self, i: int) -> SSHNode:
        spec = self.specs.get(i, NodeSpec())
        address = self.addresses[i] if self.addresses else f"{loopback_prefix()}{self.first_octet + i}"
        name = self.names[i] if self.names else f"node{i}"
        node = SSHNode(name, address, self.port, self.root / name, spec,
                       netns=self.namespaces[i] if self.namespaces else None)
        node.root.mkdir()
        _keygen(node.host_key, f"host-{name}")
        shutil.copy(f"{self.identity}.pub", node.root / "authorized_keys")
        os.chmod(node.root, 0o755)
        os.chmod(node.root / "authorized_keys", 0o644)
        if spec.share_home_with is not None:
            os.symlink(self.nodes[spec.share_home_with].home_dir, node.home_dir)
            return node
        node.home_dir.mkdir(mode=0o700)
        if spec.noisy:
            banner = BANNER.format(node=name)
            for rc in (".bashrc", ".profile", ".zshenv"):
                (node.home_dir / rc).write_text(f"echo '{banner}'\necho 'rc on stderr' >&2\n"
                                                f"export DB_PASS={LOGIN_SECRET}\n")
            fish = node.home_dir / ".config" / "fish"
            fish.mkdir(parents=True)
            (fish / "config.fish").write_text(f"echo '{banner}'\n")
        if spec.workdir_link:
            (node.home_dir / "data" / "nodectl").mkdir(parents=True)
            os.symlink("data/nodectl", node.home_dir / "work-link")
        if spec.user != "root":
            shell = SHELLS[spec.shell] if os.path.exists(SHELLS[spec.shell]) else "/bin/bash"  # zsh/fish missing
            entry = ensure_user(spec.user, shell)
            for path in [node.home_dir, *node.home_dir.rglob("*")]:
                os.lchown(path, entry.pw_uid, entry.pw_gid)
        return node

    def _namespace_script(self, node: SSHNode) -> str:
        """Runs as root inside the node's new mount namespace, then becomes its sshd."""
        venv = Path(sys.prefix)
        base = Path(sys.base_prefix)
        home_source = node.root / "home"
        hidden = list(HIDDEN) + [str(p) for p in {REPO, Path.cwd()} if not str(p).startswith(HIDDEN)]
        lines = [
            "set -e",
            "mount -t tmpfs -o mode=0755 nodectl-stage /srv",
            "mkdir /srv/node /srv/home /srv/venv /srv/base",
            f"mount --bind {shlex.quote(str(node.root))} /srv/node",
            f"mount --bind {shlex.quote(str(home_source.resolve()))} /srv/home",
            f"mount --bind {shlex.quote(str(venv))} /srv/venv",
            f"mount --bind {shlex.quote(str(base))} /srv/base",
        ]
        lines += [f"mount -t tmpfs -o mode=1777 nodectl-hide {shlex.quote(path)}" for path in hidden
                  if os.path.isdir(path)]
        lines += ["mount -t tmpfs -o mode=0711 nodectl-hide /root",
                  f"mkdir -p {shlex.quote(node.home)}",
                  f"mount --bind /srv/home {shlex.quote(node.home)}",
                  "mkdir -p /opt/venv", "mount --bind /srv/venv /opt/venv"]
        if str(base).startswith(("/root",) + HIDDEN):
            lines += [f"mkdir -p {shlex.quote(str(base))}", f"mount --bind /srv/base {shlex.quote(str(base))}"]
        options = {
            "ListenAddress": f"{node.address}:{node.port}", "HostKey": "/srv/node/ssh_host_ed25519_key",
            "AuthorizedKeysFile": "/srv/node/authorized_keys", "PidFile": "none", "StrictModes": "no",
            "UsePAM": "no", "PasswordAuthentication": "no", "KbdInteractiveAuthentication": "no",
            "PermitRootLogin": "yes", "MaxStartups": "500", "MaxSessions": "500", "LogLevel": "VERBOSE",
            "AllowTcpForwarding": "yes",
        }
        if node.spec.sftp:
            options["Subsystem"] = "sftp internal-sftp"
        argv = [SSHD, "-D", "-e", "-f", "/dev/null"]
        for key, value in options.items():
            argv += ["-o", f"{key}={value}"]
        lines.append("exec " + shlex.join(argv))
        return "\n".join(lines)

    def _sshd(self, node: SSHNode) -> subprocess.Popen:
        argv = (["ip", "netns", "exec", node.netns] if node.netns else []) + \
            ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", self._namespace_script(node)]
        log = open(node.root / "sshd.log", "ab")
        return subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)

    def stop_node(self, index: int) -> None:
        """The node's sshd goes down with its sessions (`sshd: root@notty`, one per open connection, which
        outlive the listener otherwise); what was started on the node keeps running, as on a machine whose sshd
        died."""
        proc = self.nodes[index].process
        if proc and proc.poll() is None:
            sessions = _sshd_sessions_under(proc.pid)
            proc.terminate()
            proc.wait(5)
            for pid in sessions:
                try:
                    os.kill(pid, signal.SIGTERM)
                except OSError:
                    pass

    def restart_node(self, index: int) -> None:
        self.nodes[index].process = self._sshd(self.nodes[index])
        self._wait_up(self.nodes[index])

    def stop(self) -> None:
        for i in range(len(self.nodes)):
            self.stop_node(i)

    def known_hosts_lines(self, nodes: list[SSHNode] | None = None) -> list[str]:
        lines = []
        for node in nodes or self.nodes:
            public = Path(f"{node.host_key}.pub").read_text().split()
            host = node.address if node.port == 22 else f"[{node.address}]:{node.port}"
            lines.append(f"{host} {public[0]} {public[1]}")
        return lines

    def trust_host_keys(self) -> None:
        """Write known_hosts for every node, as a user who had verified them would have."""
        (self.home / ".ssh" / "known_hosts").write_text("\n".join(self.known_hosts_lines()) + "\n")

    def node_entry(self, i: int) -> dict:
        node = self.nodes[i]
        entry = {"host": node.address, "name": node.name}
        if node.spec.user != "root":
            entry["user"] = node.spec.user
        if node.spec.workdir_link:
            entry["workdir"] = node.workdir_setting
        return entry

    def inventory(self, path: Path | None = None, python: str | None = None, count: int | None = None,
                  extra_nodes: list[dict] | None = None, node_overrides: dict[int, dict] | None = None,
                  indices: list[int] | None = None, master_port: int | None = None, **defaults) -> Path:
        """Write a hosts.yaml for the first `count` nodes (or those of `indices`); returns its path."""
        chosen = indices if indices is not None else list(range(count or len(self.nodes)))
        nodes = []
        for i in chosen:
            entry = self.node_entry(i)
            entry.update((node_overrides or {}).get(i, {}))
            nodes.append(entry)
        nodes += extra_nodes or []
        document = {"defaults": {"user": "root", "port": self.port, "identity_file": str(self.identity),
                                 "python": python or NODE_PYTHON, "device": "cpu", "gpus": 1, **defaults},
                    "nodes": nodes}
        if master_port:
            document = {"master_port": master_port, **document}
        path = path or self.root / "hosts.yaml"
        path.write_text(yaml.safe_dump(document, sort_keys=False))
        return path

    def env(self, **extra: str) -> dict[str, str]:
        """The environment a test runs nodectl in: the cluster's HOME, never the user's ~/.ssh."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SSH_AUTH_SOCK", "NODECTL_"))}
        env.update(HOME=str(self.home), PYTHONUNBUFFERED="1", COLUMNS="200", **extra)
        return env

    def node_file(self, index: int, relative: str, text: str, mode: int = 0o644) -> str:
        """Write a file into node `index`'s home (owned by its user); returns its path as the node sees it."""
        node = self.nodes[index]
        path = node.home_dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(mode)
        if node.spec.user != "root":
            entry = pwd.getpwnam(node.spec.user)
            for item in [path, *path.relative_to(node.home_dir).parents]:
                os.lchown(node.home_dir / item, entry.pw_uid, entry.pw_gid)
        return f"{node.home}/{relative}"

    def on_node(self, index: int, command: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """Run a shell command inside node `index`'s mount namespace as its user (to set up or inspect it)."""
        node = self.nodes[index]
        argv = ["nsenter", "-t", str(node.process.pid), "-m", "--", "su", "-s", "/bin/sh", node.spec.user, "-c",
                command]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def _sshd_sessions_under(root: int) -> list[int]:
    """The sshd processes below `root` (the per-connection ones of a listener)."""
    parents, names = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            names[int(entry)] = stat[stat.index("(") + 1:stat.rindex(")")]
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, todo = [], [root]
    while todo:
        current = todo.pop()
        for pid, parent in parents.items():
            if parent == current:
                todo.append(pid)
                if names.get(pid) == "sshd":
                    found.append(pid)
    return found


def netns_available() -> bool:
    if os.geteuid() != 0 or not shutil.which("ip"):
        return False
    probe = subprocess.run(["ip", "netns", "add", "nodectl-probe"], capture_output=True)
    subprocess.run(["ip", "netns", "del", "nodectl-probe"], capture_output=True)
    return probe.returncode == 0


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


@contextmanager
def namespaced_cluster(root: Path, count: int, subnet: str, tag: str, offline: bool = False):
    """Nodes in network namespaces of their own, each joined to this machine by a veth pair on
    <subnet>.<k>.0/24 (node k at <subnet>.<k>.2); they reach each other through this machine. `offline` adds a
    firewall inside each namespace: nothing leaves it but for <subnet>/16 (the controller and the other nodes), so
    no package index and no internet."""
    names = [f"nodectl-{tag}{k}" for k in range(count)]
    for k, ns in enumerate(names):
        # `ip netns exec` binds /etc/netns/<ns>/* over /etc: the nodes name each other without a DNS server, and
        # any other lookup fails at once. (With the machine's resolver, unreachable from here, torch's c10d
        # waited on reverse lookups for ~35 s before the first step.)
        etc = Path("/etc/netns") / ns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        # Each node's host name (this machine's: no UTS namespace) resolves to its own address, as a real node's
        # does: gloo binds the address its host name resolves to (127.0.0.1 when it does not resolve).
        (etc / "hosts").write_text(f"127.0.0.1 localhost\n{subnet}.{k}.2 {socket.gethostname()}\n"
                                   + "".join(f"{subnet}.{i}.2 nodectl-node{i}\n" for i in range(count)))
    ip_forward = Path("/proc/sys/net/ipv4/ip_forward")
    before = ip_forward.read_text().strip()
    try:
        for k, ns in enumerate(names):
            host_if, node_if = f"nc{tag}h{k}", f"nc{tag}n{k}"
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # left by a killed earlier run
            subprocess.run(["ip", "link", "del", host_if], capture_output=True)
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", node_if)
            _sh("ip", "link", "set", node_if, "netns", ns)
            _sh("ip", "addr", "add", f"{subnet}.{k}.1/24", "dev", host_if)
            _sh("ip", "link", "set", host_if, "up")
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", node_if, "name", "eth0")
            _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{subnet}.{k}.2/24", "dev", "eth0")
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            _sh("ip", "netns", "exec", ns, "ip", "route", "add", "default", "via", f"{subnet}.{k}.1")
            if offline:
                for rule in (["-o", "lo", "-j", "ACCEPT"], ["-d", f"{subnet}.0.0/16", "-j", "ACCEPT"],
                             ["-j", "REJECT"]):
                    _sh("ip", "netns", "exec", ns, "iptables", "-A", "OUTPUT", *rule)
        ip_forward.write_text("1")  # the namespaces reach each other through here
        cluster = SSHCluster(root, count=count, addresses=[f"{subnet}.{k}.2" for k in range(count)],
                             namespaces=names).start()
        cluster.trust_host_keys()
        try:
            yield cluster
        finally:
            cluster.stop()
    finally:
        ip_forward.write_text(before)
        for k, ns in enumerate(names):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            subprocess.run(["ip", "link", "del", f"nc{tag}h{k}"], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


def make_cluster(tmp_path_factory, count: int, first_octet: int, specs: dict | None = None, **kwargs) -> SSHCluster:
    if not sshd_available():
        pytest.skip("openssh-server is not installed (apt-get install openssh-server)")
    if not isolation_available():
        pytest.skip("simulated nodes need mount namespaces (root and unshare)")
    return SSHCluster(tmp_path_factory.mktemp("ssh"), count=count, first_octet=first_octet, specs=specs or {},
                      **kwargs).start()


@contextmanager
def running_cluster(tmp_path_factory, count: int, first_octet: int, **kwargs) -> Iterator[SSHCluster]:
    """A cluster of its own for one test or module, its host keys trusted, stopped after."""
    cluster = make_cluster(tmp_path_factory, count, first_octet=first_octet, **kwargs)
    try:
        cluster.trust_host_keys()
        yield cluster
    finally:
        cluster.stop()
