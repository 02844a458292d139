"""Faults injected into real runs on real sshd nodes: dying ranks, a killed controller, unreachable nodes."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from support.cli import run_nodectl
from support.launch import kill_leftovers, latest_run_id, run_processes, wait_for

pytestmark = pytest.mark.slow

FAULTY = '''\
import os, signal, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"rank {rank} up", flush=True)
dist.barrier()
if rank == int(os.environ.get("BAD_RANK", "-1")):
    time.sleep(1)
    mode = os.environ["FAULT"]
    print(f"injecting {mode}", flush=True)
    if mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "raise":
        raise RuntimeError("injected failure")
    sys.exit(5)
time.sleep(float(os.environ.get("HOLD", "120")))
'''


@pytest.fixture
def project(project):
    (project / "faulty.py").write_text(FAULTY)
    return project


@pytest.mark.parametrize("fault,code_text", [("sigkill", "killed by SIGKILL"), ("exit", "exit code 5"),
                                             ("raise", "exit code 1")])
def test_a_failing_rank_stops_the_run_everywhere(ssh_cluster, project, fault, code_text):
    inventory = ssh_cluster.inventory(count=2, gpus=2, env={"BAD_RANK": "2", "FAULT": fault})
    started = time.monotonic()
    result = run_nodectl(["-i", str(inventory), "launch", "--skip-preflight", "--grace", "2", "--", "faulty.py"],
                         env=ssh_cluster.env(), cwd=project, timeout=120)
    elapsed = time.monotonic() - started
    run_id = latest_run_id(project)
    try:
        assert result.exit_code == 1, result.output
        assert f"rank 2 on node node1 failed ({code_text})" in result.stderr
        assert "injecting" in result.stderr  # the failing rank's last lines
        if fault == "raise":
            assert "RuntimeError: injected failure" in result.stderr
        assert run_processes(run_id) == []
        assert elapsed < 60
    finally:
        kill_leftovers(run_id)


def test_controller_killed_the_run_goes_on_and_a_new_shell_manages_it(ssh_cluster, project):
    env = ssh_cluster.env()
    inventory = str(ssh_cluster.inventory(count=2))
    controller = subprocess.Popen([sys.executable, "-m", "nodectl", "-i", inventory, "launch", "--skip-preflight",
                                   "--", "faulty.py"], env=env, cwd=project, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
    run_id = wait_for(lambda: (project / "runs").is_dir() and any((project / "runs").iterdir())
                      and latest_run_id(project))
    try:
        wait_for(lambda: len(run_processes(run_id)) >= 4, timeout=60)
        controller.send_signal(signal.SIGKILL)
        controller.wait(10)
        time.sleep(2)
        assert len(run_processes(run_id)) >= 4  # the ranks live on
        # from a new shell the run is running (a rank still being started is "starting": under load it can
        # be, 2 s after the controller died)
        def states():
            return {r["state"] for r in run_nodectl(["--json", "status"], env=env, cwd=project).json()["ranks"]}

        assert wait_for(lambda: states() == {"running"}, timeout=60, interval=1)
        # from a new shell: the rank may still be importing torch, so wait for its line
        wait_for(lambda: "rank 1 up" in run_nodectl(["tail", "rank1"], env=env, cwd=project).stdout, timeout=60,
                 interval=1)
        assert run_nodectl(["stop", "--grace", "1"], env=env, cwd=project).exit_code == 0
        assert run_processes(run_id) == []
    finally:
        controller.kill()
        kill_leftovers(run_id)


def test_wrong_port_and_refused_key_are_clear_exit_3(ssh_cluster, tmp_path):
    wrong_port = ssh_cluster.inventory(tmp_path / "port.yaml", count=1, port=2299)
    result = run_nodectl(["-i", str(wrong_port), "--connect-timeout", "3", "env-dump"], env=ssh_cluster.env())
    assert result.exit_code == 3 and f"{ssh_cluster.nodes[0].address}:2299" in result.stderr and "Traceback" not in result.output
    assert "nothing listens on port 2299" in result.stderr and "Errno" not in result.stderr

    stranger = tmp_path / "stranger_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    refused = ssh_cluster.inventory(tmp_path / "key.yaml", count=1, identity_file=str(stranger))
    env = {**ssh_cluster.env(), "HOME": str(tmp_path / "emptyhome")}
    (tmp_path / "emptyhome" / ".ssh").mkdir(parents=True)
    (tmp_path / "emptyhome" / ".ssh" / "known_hosts").write_text(
        (ssh_cluster.home / ".ssh" / "known_hosts").read_text())
    result = run_nodectl(["-i", str(refused), "env-dump"], env=env)
    assert result.exit_code == 3 and "authentication failed" in result.stderr and "authorized_keys" in result.stderr
    assert f"identity_file {stranger}" in result.stderr and "no ssh-agent" in result.stderr

    missing = ssh_cluster.inventory(tmp_path / "missing.yaml", count=1, identity_file=str(tmp_path / "no_such_key"))
    result = run_nodectl(["-i", str(missing), "env-dump"], env=env)
    assert result.exit_code == 3 and str(tmp_path / "no_such_key") in result.stderr, result.stderr
    assert "No existing session" not in result.stderr and "Errno" not in result.stderr
