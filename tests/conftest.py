from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from sshcluster import NodeSpec, SSHCluster, isolation_available, sshd_available  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

# The files that take longest first, so the two workers finish together: xdist hands whole files out in
# collection order (pyproject.toml turns off its own reordering by test count, which sent these one-test files
# last and left one worker running them alone for minutes). Then the other files that start processes, then the
# pure ones. The order of the tests inside a file is kept.
LONGEST_FIRST = ("integration/test_environments.py", "integration/test_trainer_layouts.py", "installed/test_wheel.py",
                 "integration/test_resume_eval.py", "integration/test_outputs_store.py",
                 "integration/test_containers.py", "integration/test_real_machines.py",
                 "integration/test_preflight_ssh.py", "integration/test_trainer_moe.py",
                 "integration/test_bench_reference.py", "faults/test_node_lost.py")


def pytest_collection_modifyitems(config, items) -> None:
    def weight(item) -> tuple[int, int]:
        relative = item.nodeid.split("::", 1)[0].split("tests/", 1)[-1]
        if relative in LONGEST_FIRST:
            return 0, LONGEST_FIRST.index(relative)
        return (1 if relative.split("/", 1)[0] in ("integration", "faults", "installed", "gpu") else 2), 0

    items.sort(key=weight)


@dataclass
class CLIResult:
    exit_code: int
    stdout: str
    stderr: str

    def json(self):
        return json.loads(self.stdout)

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def run_nodectl(args: list[str], env: dict | None = None, cwd: Path | None = None, timeout: float = 180,
                input: str | None = None) -> CLIResult:
    """nodectl as a user runs it: a separate process, its real exit code, stdout and stderr apart."""
    proc = subprocess.run([sys.executable, "-m", "nodectl", *args], capture_output=True, text=True,
                          env=env or os.environ.copy(), cwd=cwd, timeout=timeout, input=input)
    return CLIResult(proc.returncode, proc.stdout, proc.stderr)


# The session cluster: three nodes that share nothing with the controller and differ the way real machines do.
# node0 logs in as root (the master; its shell start-up files print a banner), node1 as a user whose login shell
# is zsh on an sshd without sftp, node2 as a user whose login shell is fish and whose workdir is a symlink.
SESSION_SPECS = {
    0: NodeSpec(noisy=True),
    1: NodeSpec(user="nodectl-zsh", shell="zsh", sftp=False, noisy=True),
    2: NodeSpec(user="nodectl-fish", shell="fish", workdir_link=True),
}


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory):
    """One built-in demo model and data set for the trainer tests of a session (NODECTL_DEMO_CACHE)."""
    return tmp_path_factory.mktemp("demo-cache")


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


@pytest.fixture(scope="session")
def ssh_cluster(tmp_path_factory):
    """Three real sshd nodes on 127.0.0.2-4 (127.<n>.0.2-4 in xdist worker n) with trusted host keys."""
    cluster = make_cluster(tmp_path_factory, 3, first_octet=2, specs=SESSION_SPECS)
    cluster.trust_host_keys()
    yield cluster
    cluster.stop()


@pytest.fixture
def fresh_cluster(tmp_path_factory):
    """Two sshd nodes (127.0.0.20-21) whose host keys the client has never seen; one per test. node0's user
    has /bin/sh (dash) as login shell."""
    cluster = make_cluster(tmp_path_factory, 2, first_octet=20, specs={0: NodeSpec(user="nodectl-sh", shell="sh")})
    yield cluster
    cluster.stop()


@pytest.fixture(autouse=True)
def no_user_ssh_config(monkeypatch, tmp_path):
    """Keep the user's ~/.ssh and inventory out of in-process code too (fabric's no_user_ssh_config)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    monkeypatch.delenv("NODECTL_INVENTORY", raising=False)


def _processes_of_runs_under(folder: str) -> list[int]:
    """Live processes of a run whose run folder is under `folder` (a local node of this test)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        run_dir = next((v[len(b"NODECTL_RUN_DIR="):] for v in environ if v.startswith(b"NODECTL_RUN_DIR=")), b"")
        if state != "Z" and run_dir.decode(errors="replace").startswith(folder):
            found.append(int(entry))
    return found


@pytest.fixture(autouse=True)
def no_process_left_behind(tmp_path):
    """A test whose run (on a local node, its folder under the test's tmp_path) leaves a process behind fails:
    a stray rank would hold CPU, ports or a GPU for every later test, and for a user."""
    yield
    import signal
    import time

    deadline = time.time() + 15   # a stop still in progress
    left = _processes_of_runs_under(str(tmp_path))
    while left and time.time() < deadline:
        time.sleep(0.5)
        left = _processes_of_runs_under(str(tmp_path))
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    assert not left, f"processes of this test's runs were left running: {left}"
