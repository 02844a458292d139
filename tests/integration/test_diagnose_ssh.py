"""`nodectl diagnose` and the automatic diagnosis of a stall, through the real launch path: isolated SSH nodes,
real torchrun, gloo ranks hung on purpose (the scenarios of tests/data/diagnose/scenarios/), and a third-party
script that knows nothing of nodectl."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.cli import run_nodectl
from support.launch import kill_leftovers, latest_run_id, run_processes, wait_for

pytestmark = pytest.mark.slow
SCENARIOS = Path(__file__).resolve().parents[1] / "data" / "diagnose" / "scenarios"

THIRD_PARTY = '''\
"""A plain DDP script, as found in a tutorial: argparse, a model, a loader, no nodectl anywhere."""
import argparse
import threading

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

NEVER = threading.Event()


def fetch_batch(rank, step):
    if rank == 3 and step == 2:
        NEVER.wait()          # a loader that waits for a file that never comes
    return torch.randn(8, 16)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DistributedDataParallel(torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(args.steps):
        loss = model(fetch_batch(rank, step)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
'''


@pytest.fixture
def project(project):
    for script in SCENARIOS.glob("*.py"):
        shutil.copy(script, project / script.name)
    (project / "train_ddp.py").write_text(THIRD_PARTY)
    return project


def start_hung(ssh_cluster, project, script: str) -> str:
    env = ssh_cluster.env()
    inventory = str(ssh_cluster.inventory(count=2, gpus=2))
    started = run_nodectl(["-i", inventory, "launch", "--skip-preflight", "--detach", "--", script], env=env,
                          cwd=project)
    assert started.exit_code == 0, started.output
    wait_for(lambda: run_nodectl(["tail", "all", "-n", "50"], env=env, cwd=project).output.count("hung from here")
             >= 4, timeout=150, interval=1)
    time.sleep(7)   # past the 5 s after which a pending collective is a wait
    return latest_run_id(project)


def diagnosed(ssh_cluster, project) -> tuple[dict, float]:
    started = time.monotonic()
    result = run_nodectl(["--json", "diagnose"], env=ssh_cluster.env(), cwd=project, timeout=120)
    seconds = time.monotonic() - started
    assert result.exit_code == 0, result.output
    return result.json(), seconds


@pytest.mark.quick
def test_rank_that_skips_an_all_reduce_is_named_with_node_collective_and_line(ssh_cluster, project):
    run_id = start_hung(ssh_cluster, project, "behind.py")
    try:
        found, seconds = diagnosed(ssh_cluster, project)
        print(f"\ndiagnosis of 2 nodes x 2 ranks in {seconds:.1f} s: {found['summary']}")
        assert found["kind"] == "behind" and found["culprits"] == [3]
        assert found["summary"].startswith("rank 3 on node1 never entered all_reduce #4 (group 0), which ranks 0-2")
        assert "behind.py:14" in found["summary"]
        assert [r["waits_in"]["seq"] if r["waits_in"] else None for r in found["ranks"]] == [4, 4, 4, None]
        saved = project / found["folder"]
        assert "behind.py:14" in (saved / "rank3.txt").read_text()
        assert json.loads((saved / "diagnosis.json").read_text())["culprits"] == [3]
        assert {p.name for p in saved.glob("node*.json")} == {"node0.json", "node1.json"}
        # torch's own dump, in the format torchfrtrace reads, is kept on the node for `collect`
        raw = ssh_cluster.nodes[1].workdir / "runs" / run_id / "flight" / "ondemand" / "gloo_rank_3"
        assert raw.stat().st_size > 0
        # the run itself is untouched: every rank is still alive
        status = run_nodectl(["--json", "status"], env=ssh_cluster.env(), cwd=project).json()
        assert [r["state"] for r in status["ranks"]] == ["running"] * 4
    finally:
        run_nodectl(["stop", "--grace", "1"], env=ssh_cluster.env(), cwd=project)
        kill_leftovers(run_id)


def test_ranks_that_disagree_on_a_size_in_all_gather(ssh_cluster, project):
    run_id = start_hung(ssh_cluster, project, "desync_shape.py")
    try:
        found, _ = diagnosed(ssh_cluster, project)
        assert found["kind"] == "desync" and found["culprits"] == [2]
        assert "ranks 0-1, 3 called all_gather with input [4] Float" in found["summary"]
        assert "rank 2 called all_gather with input [2] Double" in found["summary"]
    finally:
        run_nodectl(["stop", "--grace", "1"], env=ssh_cluster.env(), cwd=project)
        kill_leftovers(run_id)


def test_the_seed_case_is_diagnosed_when_the_attached_launch_declares_the_stall(ssh_cluster, project):
    """Rank 1 spins after step 1 (104% CPU in the seed report); the script writes no heartbeat, so its silent log
    is the stall. The diagnosis comes before the stop, and the manifest keeps its verdict."""
    env = ssh_cluster.env()
    inventory = str(ssh_cluster.inventory(count=2, gpus=2))
    result = run_nodectl(["-i", inventory, "launch", "--skip-preflight", "--stall-after", "8", "--grace", "1", "--",
                          "compute.py"], env=env, cwd=project, timeout=240)
    run_id = latest_run_id(project)
    try:
        assert result.exit_code == 1, result.output
        assert "no heartbeat (the script writes none) and no output for" in result.stderr
        assert "diagnosing every rank" in result.stderr
        assert "rank 1 on node0 is stuck in compute at compute.py:13" in result.stderr
        assert result.stderr.index("diagnosing every rank") < result.stderr.index("stopping the run on every node")
        # the culprit first, then what noticed the stall (a waiting rank's silence); no advice to stop what
        # nodectl is stopping
        said = result.stderr
        assert said.index("rank 1 on node0 is stuck in compute") < said.index("(noticed as: ")
        assert "nodectl is stopping the run now (--on-stall stop)" in said and "  - nodectl stop" not in said
        failure = json.loads((project / "runs" / run_id / "manifest.json").read_text())["failure"]
        assert failure["kind"] == "stalled" and failure["diagnosis"]["kind"] == "compute"
        assert run_processes(run_id) == []
        # one failure story: the culprit the diagnosis named, in the launch's last words, status, runs and the
        # manifest alike; what nodectl's own stop did to the waiting ranks is no cause
        assert failure["rank"] == 1 and failure["node"] == "node0"
        assert failure["description"].startswith("stalled: rank 1 on node0 is stuck in compute at compute.py:13")
        verdict = result.stderr[result.stderr.index(f"run {run_id} failed:"):]
        assert " ".join(verdict.split()).startswith(f"run {run_id} failed: {failure['description']}"[:90])
        assert "last lines of rank 1:" in verdict and "last lines of rank 0" not in verdict
        status = run_nodectl(["--json", "status"], env=env, cwd=project).json()
        assert status["cause"] == failure["description"] and status["first_failure"]["rank"] == 1
        shown = run_nodectl(["status"], env=env, cwd=project).stdout
        assert "cause: stalled: rank 1 on node0" in " ".join(shown.split()) and "SIGTERM" not in shown
        listed = run_nodectl(["--json", "runs"], env=env, cwd=project).json()["runs"]
        assert [r["cause"] for r in listed if r["run_id"] == run_id] == [failure["description"]]
    finally:
        kill_leftovers(run_id)


def test_a_healthy_run_with_long_steps_is_neither_stalled_nor_diagnosed(ssh_cluster, project):
    env = ssh_cluster.env(STEPS="4")
    inventory = str(ssh_cluster.inventory(count=2, gpus=1, env={"STEPS": "4"}))
    result = run_nodectl(["-i", inventory, "launch", "--skip-preflight", "--stall-after", "8", "--", "healthy.py"],
                         env=env, cwd=project, timeout=240)
    assert result.exit_code == 0, result.output
    assert "done" in result.output
    assert "stalled" not in result.output and "diagnos" not in result.output
    assert not (project / "runs" / latest_run_id(project) / "diagnosis").exists()


def test_a_third_party_script_hung_on_purpose_is_diagnosed_and_kept_alive(ssh_cluster, project):
    """An unmodified DDP script: rank 3's loader waits forever at step 2. `--on-stall keep` diagnoses the stall
    and leaves the run up; `nodectl diagnose` then names the rank and the line; `stop` ends it."""
    env = ssh_cluster.env()
    inventory = str(ssh_cluster.inventory(count=2, gpus=2))
    controller = subprocess.Popen([sys.executable, "-m", "nodectl", "-i", inventory, "launch", "--skip-preflight",
                                   "--stall-after", "10", "--on-stall", "keep", "--", "train_ddp.py", "--steps", "50"],
                                  cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_id = None
    try:
        lines = []
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline:
            line = controller.stderr.readline()
            if not line:
                break
            lines.append(line)
            if "goes on" in line:
                break
        said = "".join(lines)
        run_id = latest_run_id(project)
        assert "diagnosing every rank" in said and "--on-stall keep" in said, said
        assert "rank 3 on node1" in said and "train_ddp.py:14 in `fetch_batch`" in said, said
        assert controller.poll() is None  # still watching, the run kept
        found, _ = diagnosed(ssh_cluster, project)
        assert found["kind"] == "behind" and found["culprits"] == [3]
        assert "train_ddp.py:14 in `fetch_batch`" in found["summary"] and "NEVER.wait()" in found["summary"]
        stopped = run_nodectl(["stop", "--grace", "1"], env=env, cwd=project)
        assert stopped.exit_code == 0, stopped.output
        assert controller.wait(timeout=60) == 1
        assert run_processes(run_id) == []
        # one hang, one diagnosis: not one more for each rank that fell silent after the first
        assert (said + controller.stderr.read()).count("diagnosing every rank") == 1
    finally:
        if controller.poll() is None:
            controller.kill()
            controller.wait()
        if run_id:
            run_nodectl(["stop", "--grace", "1"], env=env, cwd=project)
            kill_leftovers(run_id)
