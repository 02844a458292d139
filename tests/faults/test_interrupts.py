"""Ctrl-C never deadlocks the controller (issue 40): SIGINT at many points of a launch (preflight, sending the
project, starting, attending) and of a stop ends nodectl with 130 within seconds every time, and leaves no
process of the run on the isolated nodes. A signal handler that takes a lock (threading.Event.set) hung it for good
in 2 of 3 tries, three handlers deep."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from support.cli import run_nodectl

from support.sshcluster import running_cluster
from support.launch import kill_leftovers, latest_run_id, run_processes, via_proxycommand, wait_for
from support.sshcluster import NODE_PYTHON

pytestmark = pytest.mark.slow
HOLD = "import time\nprint('holding on', flush=True)\ntime.sleep(600)\n"
STUBBORN = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('holding on', flush=True)\n" \
           "time.sleep(600)\n"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory, 2, first_octet=170) as cluster:
        yield cluster


def interrupted(argv: list[str], env: dict, cwd, after: float) -> tuple[int, float, str]:
    proc = subprocess.Popen([sys.executable, "-m", "nodectl", *argv], env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(after)
    pressed = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=45)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return -1, time.monotonic() - pressed, err
    return proc.returncode, time.monotonic() - pressed, out + err


@pytest.mark.parametrize("after", [0.4, 1.2, 2.5, 4.0])
def test_sigint_at_any_point_of_a_launch_exits_130_within_seconds(cluster, tmp_path, after):
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "train.py").write_text(HOLD)
    for i in range(2):   # a project that takes a moment to send
        (project / "data" / f"part{i}.bin").write_bytes(os.urandom(8 << 20))
    env = cluster.env(NODECTL_INVENTORY=str(cluster.inventory()))
    code, seconds, output = interrupted(["launch", "--grace", "2", "--", "train.py"], env, project, after)
    runs = [p for p in (project / "runs").iterdir() if p.name[0].isdigit()] if (project / "runs").is_dir() else []
    try:
        assert code == 130, f"exit {code} after SIGINT at {after} s: {output[-2000:]}"
        assert seconds < 20, f"{seconds:.0f} s to exit after SIGINT at {after} s"
        for run in runs:
            assert run_processes(run.name) == [], f"run {run.name} left processes (SIGINT at {after} s)"
    finally:
        for run in runs:
            kill_leftovers(run.name)


@pytest.mark.parametrize("after", [0.3, 1.0])
def test_sigint_at_any_point_of_a_stop_exits_130_within_seconds(cluster, tmp_path, after):
    project = tmp_path / "project"
    project.mkdir()
    (project / "stubborn.py").write_text(STUBBORN)
    env = cluster.env(NODECTL_INVENTORY=str(cluster.inventory()))
    started = run_nodectl(["launch", "--skip-preflight", "--detach", "--", "stubborn.py"], env=env, cwd=project)
    assert started.exit_code == 0, started.output
    run_id = latest_run_id(project)
    try:
        wait_for(lambda: run_nodectl(["tail", "all"], env=env, cwd=project).stdout.count("holding on") >= 2)
        code, seconds, output = interrupted(["stop", "--grace", "120"], env, project, after)
        assert code == 130 and seconds < 20, f"exit {code} in {seconds:.0f} s (SIGINT at {after} s): {output[-2000:]}"
        if run_processes(run_id):   # SIGINT before the stop reached the nodes: a second stop ends it
            assert run_nodectl(["stop", "--grace", "1"], env=env, cwd=project).exit_code == 0
        assert run_processes(run_id) == []
    finally:
        kill_leftovers(run_id)


CHECKPOINTER = """\
import os, time
out = os.environ["NODECTL_OUTPUT_DIR"]
if os.environ["NODECTL_ATTEMPT"] == "0":
    with open(os.path.join(out, f"ckpt-100-rank{os.environ['RANK']}.pt"), "wb") as handle:
        handle.write(os.urandom(256 << 10))
    print("ckpt-100 written", flush=True)
else:
    print("holding on", flush=True)
    time.sleep(600)
"""


def test_sigint_at_every_second_of_a_resume_leaves_the_earlier_checkpoints_byte_for_byte(cluster, tmp_path):
    """A resumed run's folder holds earlier attempts: Ctrl-C while the resume prepares, fills or starts it removed
    the whole folder, checkpoints included, on both nodes. Now every interrupt leaves them as they were."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text(CHECKPOINTER)
    env = cluster.env(NODECTL_INVENTORY=str(cluster.inventory()))
    first = run_nodectl(["launch", "--skip-preflight", "--", "train.py"], env=env, cwd=project)
    assert first.exit_code == 0, first.output
    run_id = latest_run_id(project)
    folders = [node.workdir / "runs" / run_id for node in cluster.nodes[:2]]
    kept = {path: path.read_bytes() for folder in folders for path in (folder / "output").iterdir()}
    assert len(kept) == 2, kept
    try:
        # every second of the resume, then (on a loaded machine, where an attempt starts later) on until one did
        for after in (0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 8.5, 11.0, 14.0, 18.0):
            if after > 6.5 and (folders[0] / "attempts").is_dir():
                break
            code, seconds, output = interrupted(["launch", "--resume", run_id, "--skip-preflight", "--grace", "2"],
                                                env, project, after)
            assert code == 130 and seconds < 20, f"exit {code} in {seconds:.0f} s (SIGINT at {after} s): {output}"
            for path, data in kept.items():
                assert path.is_file() and path.read_bytes() == data, f"{path} changed or went (SIGINT at {after} s)"
            assert run_processes(run_id) == [], f"processes left (SIGINT at {after} s)"
        assert (folders[0] / "attempts").is_dir(), "an attempt that started was archived, not removed"
    finally:
        kill_leftovers(run_id)


def test_ctrl_c_through_a_proxycommand_host_stops_the_run(tmp_path_factory, tmp_path):
    """The node is reached only through ~/.ssh/config's ProxyCommand (its HostName, 192.0.2.1, is TEST-NET).
    Ctrl-C at a terminal signals the whole foreground process group, the proxy included: it died with nodectl's
    first SIGINT, so the stop that followed could not reach the node and the run went on while nodectl said it had
    stopped it. The proxy runs in a session of its own now: the run is stopped, exit 130."""
    with running_cluster(tmp_path_factory, 1, first_octet=210) as cluster:
        [target] = cluster.nodes
        via_proxycommand(cluster, target, tmp_path)
        inventory = tmp_path / "hosts.yaml"
        inventory.write_text(f"defaults: {{device: cpu, python: {NODE_PYTHON}}}\n"
                             f"nodes:\n  - {{host: viacmd, name: n0, addr: {target.address}}}\n")
        project = tmp_path / "project"
        project.mkdir()
        (project / "train.py").write_text(HOLD)
        env = cluster.env(NODECTL_INVENTORY=str(inventory))
        proc = subprocess.Popen([sys.executable, "-m", "nodectl", "--connect-timeout", "5", "launch", "--skip-preflight",
                                 "--grace", "2", "--", "train.py"], env=env, cwd=project, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        run_id = None
        try:
            run_id = wait_for(lambda: (project / "runs").is_dir() and any(
                p.name[0].isdigit() for p in (project / "runs").iterdir()) and latest_run_id(project), timeout=60)
            wait_for(lambda: run_processes(run_id) or None, timeout=60)
            time.sleep(1)
            os.killpg(proc.pid, signal.SIGINT)          # what the terminal does with Ctrl-C
            out, _ = proc.communicate(timeout=45)
            assert proc.returncode == 130, out[-2000:]
            wait_for(lambda: not run_processes(run_id), timeout=15)
        finally:
            if proc.poll() is None:
                proc.kill()
            if run_id:
                kill_leftovers(run_id)


WRITE = "import os\nout = os.environ['NODECTL_OUTPUT_DIR']\n" \
        "open(os.path.join(out, 'blob.bin'), 'wb').write(os.urandom(24 << 20))\nprint('written', flush=True)\n"


def test_a_collect_killed_with_sigkill_leaves_no_archive_on_the_node(cluster, tmp_path):
    """`collect` killed by SIGKILL (no handler runs) at several points: while the node packs (runctl notices
    that its caller is gone and removes the archive) and while the archive travels (it was unlinked on the node
    as soon as it was open for reading). Before, every kill after the pack left the 24 MB archive there."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "write.py").write_text(WRITE)
    env = cluster.env(NODECTL_INVENTORY=str(cluster.inventory(count=1)))
    launched = run_nodectl(["launch", "--skip-preflight", "--", "write.py"], env=env, cwd=project)
    assert launched.exit_code == 0, launched.output
    run_id = latest_run_id(project)
    listing = f"ls -a ~/nodectl/runs/{run_id}"
    assert "output" in cluster.on_node(0, listing).stdout
    for after in (1.0, 1.6, 2.4):
        proc = subprocess.Popen([sys.executable, "-m", "nodectl", "collect", "--run", run_id], env=env, cwd=project,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(after)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 20
        while ".collect" in (shown := cluster.on_node(0, listing).stdout) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert ".collect" not in shown, f"an archive is left on the node after SIGKILL at {after} s: {shown}"
    collected = run_nodectl(["collect", "--run", run_id], env=env, cwd=project)
    assert collected.exit_code == 0, collected.output
    assert [p.stat().st_size for p in (project / "runs" / run_id).rglob("blob.bin")] == [24 << 20]
    assert ".collect" not in cluster.on_node(0, listing).stdout
