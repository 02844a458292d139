"""Your own script's metrics through nodectl_metrics, seen by status, top and report; top's GPU columns."""
from __future__ import annotations

import pytest

import json
import os
import subprocess
import sys

from support import REPO

from support.cli import run_nodectl
from support.launch import kill_leftovers, wait_for

SCRIPT = '''\
import os, time
import torch.distributed as dist
from nodectl_metrics import report
dist.init_process_group("gloo")
rank = dist.get_rank()
steps = int(os.environ["STEPS"])
for step in range(1, steps + 1):
    report(step=step, loss=10.0 / step + rank, tokens=512, grad_norm=0.5 * rank)
    time.sleep(0.1)
dist.barrier()
dist.destroy_process_group()
'''


@pytest.mark.quick
def test_a_scripts_own_metrics_reach_status_top_and_report(ssh_cluster, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text(SCRIPT)
    env = ssh_cluster.env()
    inventory = str(ssh_cluster.inventory(count=2, env={"STEPS": "150"}))
    started = run_nodectl(["-i", inventory, "--json", "launch", "--skip-preflight", "--detach", "--", "train.py"],
                          env=env, cwd=project)
    assert started.exit_code == 0, started.output
    run_id = started.json()["run_id"]
    try:
        beat = ssh_cluster.nodes[1].workdir / "runs" / run_id / "heartbeat" / "rank1.json"
        wait_for(lambda: beat.is_file() and json.loads(beat.read_text())["step"] >= 3, timeout=90, interval=0.1)
        top = run_nodectl(["top", "--once", "--json", "--run", run_id], env=env, cwd=project)
        assert top.exit_code == 0, top.output
        rows = {row["rank"]: row for row in top.json()["ranks"]}
        assert top.json()["state"] == "running" and set(rows) == {0, 1}
        assert rows[1]["state"] == "running" and rows[1]["node"] == "node1" and rows[1]["step"] >= 3
        assert 1.0 < rows[1]["loss"] <= 1.0 + 10.0 / 3  # rank 1 reports 10/step + 1
        assert 1000 < rows[1]["tokens_per_s"] < 6000   # 512 tokens every ~0.1 s
        assert rows[1]["gpu"] is None                  # CPU nodes: no nvidia-smi, no GPU columns
        table = run_nodectl(["top", "--run", run_id], env=env, cwd=project)  # not a terminal: one table
        assert table.exit_code == 0 and "node1" in table.stdout and "tok/s" in table.stdout
        wait_for(lambda: run_nodectl(["--json", "status", "--run", run_id], env=env,
                                     cwd=project).json()["state"] == "succeeded", timeout=90, interval=1)
    finally:
        kill_leftovers(run_id)
    status = run_nodectl(["status", "--json", "--run", run_id], env=env, cwd=project).json()
    assert [(row["step"], round(row["loss"], 4)) for row in status["ranks"]] == [(150, round(10 / 150, 4)),
                                                                                 (150, round(1 + 10 / 150, 4))]
    assert run_nodectl(["collect", "--run", run_id], env=env, cwd=project).exit_code == 0
    report = run_nodectl(["--json", "report", run_id], env=env, cwd=project)
    assert report.exit_code == 0, report.output
    assert report.json()["summary"]["steps"] == 150
    assert abs(report.json()["summary"]["last_loss"] - 10 / 150) < 1e-9
    folder = project / "runs" / run_id / "report"
    assert (folder / "loss.png").is_file() and (folder / "metric_grad_norm.png").is_file()


def test_top_reads_the_gpus_through_nvidia_smi(tmp_path):
    """runctl's GPU sample on a node with a driver, from nvidia-smi's CSV (a fake one here: no GPU on this machine;
    the GPU machine run in docs/PERFORMANCE.md shows the real one)."""
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho '0, 97, 70123, 143771, 61, 512.30'\necho '1, 0, 5, 143771, 30, [N/A]'\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    code = "import sys, json; sys.path.insert(0, sys.argv[1]); from runctl.watch import gpu_sample; print(json.dumps(gpu_sample()))"
    out = subprocess.run([sys.executable, "-c", code, str(REPO / "launchers")], env=env, capture_output=True,
                         text=True, check=True)
    gpus = json.loads(out.stdout)["gpus"]
    assert gpus[0] == {"index": 0, "util": 97.0, "mem_used_mib": 70123.0, "mem_total_mib": 143771.0, "temp_c": 61.0,
                       "power_w": 512.3}
    assert gpus[1]["power_w"] is None and gpus[1]["util"] == 0.0
    env["PATH"] = "/nonexistent"
    out = subprocess.run([sys.executable, "-c", code, str(REPO / "launchers")], env=env, capture_output=True,
                         text=True, check=True)
    assert "nvidia-smi not found" in json.loads(out.stdout)["error"]
