"""A hung rank: status calls it stalled, stacks brings back where it hangs, --stall-after stops the run."""
from __future__ import annotations

import json

import pytest

from support.cli import run_nodectl
from support.launch import kill_leftovers, latest_run_id, run_processes, wait_for

pytestmark = pytest.mark.slow

HANG = '''\
import faulthandler, json, os, pathlib, signal, time
run, rank = pathlib.Path(os.environ["NODECTL_RUN_DIR"]), os.environ["RANK"]
stack_file = pathlib.Path(os.environ["NODECTL_STACK_FILE"])
if rank == "0":   # rank 1's stack comes from its listener, with the source lines
    faulthandler.register(signal.SIGUSR1, file=open(stack_file, "a"), all_threads=True)
    stack_file.with_suffix(".ready").write_text("1")
(run / "heartbeat" / f"rank{rank}.json").write_text(json.dumps({"step": 3, "time": time.time()}))
print("heartbeat written", flush=True)


def stuck_in_collective():
    time.sleep(600)  # token = "hf_abcdefghijklmnopqrstuvwx", password=hunter2


stuck_in_collective()
'''


@pytest.fixture
def project(project):
    (project / "hang.py").write_text(HANG)
    return project


@pytest.mark.quick
def test_status_stalled_and_stacks_of_every_rank(ssh_cluster, project):
    env = ssh_cluster.env()
    inventory = str(ssh_cluster.inventory(count=2))
    started = run_nodectl(["-i", inventory, "launch", "--skip-preflight", "--detach", "--", "hang.py"], env=env,
                          cwd=project)
    assert started.exit_code == 0, started.output
    run_id = latest_run_id(project)
    try:
        beats = [n.workdir / "runs" / run_id / "heartbeat" / f"rank{i}.json" for i, n in enumerate(ssh_cluster.nodes[:2])]
        wait_for(lambda: all(b.exists() for b in beats))
        wait_for(lambda: all(r["state"] == "stalled" for r in run_nodectl(
            ["--json", "status", "--stall-after", "1"], env=env, cwd=project).json()["ranks"]), timeout=30)
        status = run_nodectl(["--json", "status", "--stall-after", "1"], env=env, cwd=project).json()
        assert [r["step"] for r in status["ranks"]] == [3, 3]
        stacks = run_nodectl(["--json", "stacks"], env=env, cwd=project)
        assert stacks.exit_code == 0, stacks.output
        gathered = stacks.json()["stacks"]
        for rank in ("0", "1"):
            assert "stuck_in_collective" in gathered[rank]["text"]
            assert "stuck_in_collective" in (project / "runs" / run_id / "stacks" / f"rank{rank}.txt").read_text()
        # a source line's secrets are masked as diagnose masks them, printed and saved
        assert "time.sleep(600)  # token = \"***\", password=***" in gathered["1"]["text"], gathered["1"]["text"]
        shown = run_nodectl(["stacks"], env=env, cwd=project)
        for text in (stacks.output, shown.output, *(p.read_text() for p in (project / "runs" / run_id / "stacks")
                                                     .iterdir())):
            assert "hf_abcdefghijklmnopqrstuvwx" not in text and "hunter2" not in text
    finally:
        run_nodectl(["stop", "--grace", "1"], env=env, cwd=project)
        kill_leftovers(run_id)


def test_stall_limit_stops_an_attached_run(ssh_cluster, project):
    env = ssh_cluster.env()
    inventory = str(ssh_cluster.inventory(count=2))
    result = run_nodectl(["-i", inventory, "launch", "--skip-preflight", "--stall-after", "2", "--grace", "1", "--",
                          "hang.py"], env=env, cwd=project, timeout=120)
    run_id = latest_run_id(project)
    try:
        assert result.exit_code == 1, result.output
        assert "stalled: no heartbeat for" in result.stderr
        assert run_processes(run_id) == []
        assert json.loads((project / "runs" / run_id / "manifest.json").read_text())["failure"]["kind"] == "stalled"
    finally:
        kill_leftovers(run_id)
