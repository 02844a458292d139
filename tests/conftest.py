from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Bytecode is written and read again: a shell that sets PYTHONDONTWRITEBYTECODE (this machine's shells do)
# left every process the suite starts (each nodectl command, runctl on a local node, each rank) compiling
# nodectl's, runctl's and the trainer's sources again, about 0.2 CPU s a command; and pytest rewrote every test
# file's assertions again in each worker.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
sys.path.insert(0, str(Path(__file__).parent))
from support import REPO  # noqa: E402,F401 - the repository, for tests that name its files
from support.launch import make_project  # noqa: E402
from support.sshcluster import NodeSpec, make_cluster  # noqa: E402

# The files that take longest first, so the workers finish together: xdist hands whole files out in
# collection order (pyproject.toml turns off its own reordering by test count, which sent these one-test files
# last and left one worker running them alone for minutes). Then the other files that start processes, then the
# pure ones. The order of the tests inside a file is kept.
LONGEST_FIRST = ("integration/test_real_machines.py", "integration/test_resume_eval.py",
                 "integration/test_containers.py", "integration/test_trainer_moe.py",
                 "integration/test_environments.py", "integration/test_trainer_layouts.py",
                 "faults/test_node_lost.py", "installed/test_wheel.py", "integration/test_outputs_store.py",
                 "integration/test_straggler.py", "faults/test_watch_liveness.py", "integration/test_diagnose_ssh.py",
                 "integration/test_preflight_ssh.py", "integration/test_trainer_runs.py", "faults/test_interrupts.py")


QUICK_FOLDERS = ("unit", "contract")


def pytest_collection_modifyitems(config, items) -> None:
    # The quick tier (`pytest -m quick`, between changes): unit and contract tests not marked slow, and the
    # end-to-end runs marked quick (one of each command, on the shared cluster).
    for item in items:
        folder = item.nodeid.split("::", 1)[0].split("tests/", 1)[-1].split("/", 1)[0]
        if folder in QUICK_FOLDERS and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.quick)

    def weight(item) -> tuple[int, int]:
        relative = item.nodeid.split("::", 1)[0].split("tests/", 1)[-1]
        if relative in LONGEST_FIRST:
            return 0, LONGEST_FIRST.index(relative)
        return (1 if relative.split("/", 1)[0] in ("integration", "faults", "installed", "gpu") else 2), 0

    items.sort(key=weight)


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


@pytest.fixture
def project(tmp_path):
    """A project folder holding a small two-rank script (support.launch.make_project); a test adds its own files."""
    return make_project(tmp_path / "project")


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
