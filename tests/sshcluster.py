"""Real OpenSSH servers on loopback addresses, one per simulated node, for tests and benchmarks.

Each server gets its own host key and an authorized client key made here; the client side lives in a throwaway
HOME so the user's own ~/.ssh (config, keys, known_hosts) never takes part.
"""
from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
PORT = 2222


def sshd_available() -> bool:
    return os.path.exists(SSHD) and shutil.which("ssh-keygen") is not None


def _keygen(path: Path, comment: str) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)], check=True)


def _wait_port(address: str, port: int, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with socket.create_connection((address, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"sshd on {address}:{port} did not come up")


@dataclass
class SSHNode:
    name: str
    address: str
    port: int
    workdir: Path
    host_key: Path
    process: subprocess.Popen | None = None
    netns: str | None = None


@dataclass
class SSHCluster:
    root: Path
    count: int
    port: int = PORT
    first_octet: int = 2
    nodes: list[SSHNode] = field(default_factory=list)
    addresses: list[str] | None = None     # default: 127.0.0.<first_octet + i>
    namespaces: list[str] | None = None    # run node i's sshd inside this network namespace

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def identity(self) -> Path:
        return self.home / ".ssh" / "id_ed25519"

    def start(self) -> "SSHCluster":
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege-separation directory
        ssh_dir = self.home / ".ssh"
        ssh_dir.mkdir(parents=True, mode=0o700)
        _keygen(self.identity, "nodectl-tests")
        authorized = self.root / "authorized_keys"
        shutil.copy(f"{self.identity}.pub", authorized)
        for i in range(self.count):
            address = self.addresses[i] if self.addresses else f"127.0.0.{self.first_octet + i}"
            node_dir = self.root / f"node{i}"
            node_dir.mkdir()
            host_key = node_dir / "ssh_host_ed25519_key"
            _keygen(host_key, f"host-node{i}")
            node = SSHNode(f"node{i}", address, self.port, node_dir / "work", host_key,
                           netns=self.namespaces[i] if self.namespaces else None)
            node.process = self._sshd(node, authorized)
            self.nodes.append(node)
        for node in self.nodes:
            _wait_port(node.address, node.port)
        return self

    def _sshd(self, node: SSHNode, authorized: Path) -> subprocess.Popen:
        options = {
            "ListenAddress": f"{node.address}:{node.port}", "HostKey": str(node.host_key),
            "AuthorizedKeysFile": str(authorized), "PidFile": "none", "StrictModes": "no", "UsePAM": "no",
            "PasswordAuthentication": "no", "KbdInteractiveAuthentication": "no", "PermitRootLogin": "yes",
            "Subsystem": "sftp internal-sftp", "MaxStartups": "500", "MaxSessions": "500", "LogLevel": "ERROR",
        }
        argv = (["ip", "netns", "exec", node.netns] if node.netns else []) + [SSHD, "-D", "-e", "-f", "/dev/null"]
        for key, value in options.items():
            argv += ["-o", f"{key}={value}"]
        log = open(node.host_key.parent / "sshd.log", "ab")
        return subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)

    def stop_node(self, index: int) -> None:
        proc = self.nodes[index].process
        if proc and proc.poll() is None:
            proc.terminate()
            proc.wait(5)

    def restart_node(self, index: int) -> None:
        self.nodes[index].process = self._sshd(self.nodes[index], self.root / "authorized_keys")
        _wait_port(self.nodes[index].address, self.nodes[index].port)

    def stop(self) -> None:
        for i in range(len(self.nodes)):
            self.stop_node(i)

    def trust_host_keys(self) -> None:
        """Write known_hosts for every node, as a user who had verified them would have."""
        lines = []
        for node in self.nodes:
            public = Path(f"{node.host_key}.pub").read_text().split()
            lines.append(f"[{node.address}]:{node.port} {public[0]} {public[1]}")
        (self.home / ".ssh" / "known_hosts").write_text("\n".join(lines) + "\n")

    def inventory(self, path: Path | None = None, python: str | None = None, count: int | None = None,
                  extra_nodes: list[dict] | None = None, node_overrides: dict[int, dict] | None = None,
                  **defaults) -> Path:
        """Write a hosts.yaml for the first `count` nodes; returns its path."""
        nodes = []
        for i, node in enumerate(self.nodes[: count or len(self.nodes)]):
            entry = {"host": node.address, "name": node.name, "workdir": str(node.workdir)}
            entry.update((node_overrides or {}).get(i, {}))
            nodes.append(entry)
        nodes += extra_nodes or []
        document = {"defaults": {"user": getpass.getuser(), "port": self.port, "identity_file": str(self.identity),
                                 "python": python or sys.executable, "device": "cpu", "gpus": 1, **defaults},
                    "nodes": nodes}
        path = path or self.root / "hosts.yaml"
        path.write_text(yaml.safe_dump(document, sort_keys=False))
        return path

    def env(self, **extra: str) -> dict[str, str]:
        """The environment a test runs nodectl in: the cluster's HOME, never the user's ~/.ssh."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SSH_AUTH_SOCK", "NODECTL_"))}
        env.update(HOME=str(self.home), PYTHONUNBUFFERED="1", COLUMNS="200", **extra)
        return env
