"""launch / tail / status / stop / collect / runs against real sshd nodes and real torchrun with gloo."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from support.cli import run_nodectl
from support.launch import kill_leftovers, latest_run_id, run_processes, wait_for

pytestmark = pytest.mark.slow


def nodectl_args(cluster, *args, count=2, **inventory):
    return ["-i", str(cluster.inventory(count=count, **inventory)), *args]


@pytest.mark.quick
def test_plain_script_two_nodes_two_ranks_args_intact(ssh_cluster, project, tmp_path):
    canary = tmp_path / "injected"
    token = "hf_" + "Q7x" * 10
    tricky = ["with space", f"$(touch {canary})", f"`touch {canary}`", "it's \"quoted\"", "semi;colon",
              "--hf-token", token]
    result = run_nodectl(nodectl_args(ssh_cluster, "launch", "--skip-preflight", "--gpus", "2", "--",
                                      "train.py", *tricky), env=ssh_cluster.env(), cwd=project)
    assert result.exit_code == 0, result.output
    assert "an argument looks like a secret" in result.stderr
    assert "rank=0 world=4 node=0 sum=10" in result.stdout
    run_id = latest_run_id(project)
    for rank in range(4):
        tail = run_nodectl(["-i", str(ssh_cluster.inventory(count=2)), "tail", f"rank{rank}"],
                           env=ssh_cluster.env(), cwd=project)
        assert tail.exit_code == 0, tail.output
        assert f"rank={rank} world=4 node={rank // 2}" in tail.stdout
        assert f"ARGS={tricky!r}" in tail.stdout
    assert not canary.exists()
    local = project / "runs" / run_id
    stored = [(local / "manifest.json").read_text()] + [p.read_text() for p in (local / "scripts").iterdir()]
    assert all(token not in text for text in stored) and '"***"' in stored[0]  # the rank got it; nothing kept it
    assert token in (ssh_cluster.nodes[0].workdir / "runs" / run_id / "launch.sh").read_text()
    again = run_nodectl(nodectl_args(ssh_cluster, "launch", "--resume", run_id), env=ssh_cluster.env(), cwd=project)
    assert again.exit_code == 2 and "held a secret" in again.stderr
    node_dir = ssh_cluster.nodes[1].workdir / "runs" / run_id
    assert (node_dir / "code" / "train.py").is_file() and not (node_dir / "code" / "data").exists()
    assert oct((node_dir / "env.sh").stat().st_mode & 0o777) == "0o600"
    # nothing probed (--skip-preflight), yet the launch saw both nodes on this one kernel: its CPUs over 4 ranks
    threads = max(1, len(os.sched_getaffinity(0)) // 4)
    assert f"OMP_NUM_THREADS={threads}\n" in (node_dir / "env.sh").read_text()
    manifest = json.loads((project / "runs" / run_id / "manifest.json").read_text())
    assert manifest["state"] == "succeeded" and manifest["fingerprint"]
    assert (project / "runs" / run_id / "scripts" / "node0.sh").read_text().count("--node-rank=0") == 1

    everything = run_nodectl(["tail", "all", "--run", run_id], env=ssh_cluster.env(), cwd=project)
    assert "[node1/3]" in everything.stdout
    bad = run_nodectl(["tail", "rank9"], env=ssh_cluster.env(), cwd=project)
    assert bad.exit_code == 2 and "rank3" in bad.stderr and "node1" in bad.stderr

    collected = run_nodectl(["collect"], env=ssh_cluster.env(), cwd=project)
    assert collected.exit_code == 0, collected.output
    assert "rank=3" in (project / "runs" / run_id / "nodes" / "node1" / "logs" / "rank3.log").read_text()
    assert not (project / "runs" / run_id / "nodes" / "node1" / "code").exists()
    runs = run_nodectl(["--json", "runs"], env=ssh_cluster.env(), cwd=project)
    assert runs.json()["runs"][-1]["run_id"] == run_id


def test_failing_rank_stops_every_node(ssh_cluster, project):
    env = ssh_cluster.env()
    # --resume-only (issue 68): a restart would run the script again from its start (nodectl sees no checkpoint
    # of its own), so there is none: said, and the failed run ends as it is
    result = run_nodectl(nodectl_args(ssh_cluster, "launch", "--skip-preflight", "--gpus", "2", "--grace", "3",
                                      "--max-restarts", "1", "--resume-only",
                                      "--", "train.py", node_overrides={1: {"env": {"FAIL_RANK": "3", "SLEEP": "60"}},
                                                                        0: {"env": {"SLEEP": "60"}}}),
                         env=env, cwd=project)
    run_id = latest_run_id(project)
    try:
        assert result.exit_code == 1, result.output
        assert "rank 3 on node node1 failed (exit code 7)" in result.stderr
        assert "rank is failing on purpose" in result.stderr  # its last lines
        assert "not restarting (--resume-only): attempt 1 runs the script again from its start" in result.stderr
        assert "the run ends failed" in result.stderr and "restarting run" not in result.stderr, result.stderr
        assert run_processes(run_id) == []
        status = run_nodectl(["--json", "status"], env=env, cwd=project)
        rows = {row["rank"]: row["state"] for row in status.json()["ranks"]}
        assert rows[3] == "exited(7)" and "running" not in rows.values()
        # preflight's history of node1 shows what the run saw there (issue 70); node0's shows nothing of it
        # (the session cluster's history holds other tests' runs too: this run's events are the ones asked about)
        history = run_nodectl(["--json", "preflight", "--history", "node1"], env=env, cwd=project).json()
        mine = [e for e in history["events"] if e["run"] == run_id]
        assert [(e["event"], e["node"], e["rank"], e["code"]) for e in mine] == [("failure", "node1", 3, 7)]
        assert "rank 3 on node node1 failed (exit code 7)" in mine[0]["description"]
        node0 = run_nodectl(["--json", "preflight", "--history", "node0"], env=env, cwd=project).json()["events"]
        assert [e for e in node0 if e["run"] == run_id] == []
        shown = run_nodectl(["preflight", "--history", "node1"], env={**env, "COLUMNS": "200"}, cwd=project)
        assert "held back, failed and broken in runs on node1" in shown.stdout and "failed (" in shown.stdout, shown.output
    finally:
        kill_leftovers(run_id)


def test_max_restarts_needs_an_attached_launch(ssh_cluster, project):
    """Restarts are nodectl's own (stop everywhere, a new attempt on every node: tests/integration/test_resume_eval.py and
    tests/faults/test_node_lost.py prove them end to end); a detached launch has nobody to restart it."""
    detach = run_nodectl(nodectl_args(ssh_cluster, "launch", "--detach", "--max-restarts", "1", "--", "train.py"),
                         env=ssh_cluster.env(), cwd=project)
    assert detach.exit_code == 2 and "--max-restarts needs an attached launch" in detach.stderr
    alone = run_nodectl(nodectl_args(ssh_cluster, "launch", "--resume-only", "--", "train.py"), env=ssh_cluster.env(),
                        cwd=project)
    assert alone.exit_code == 2 and "--resume-only decides whether a restart happens: give --max-restarts N too" \
        in alone.stderr
    assert not (project / "runs").exists() or not [p for p in (project / "runs").iterdir() if p.name[0].isdigit()]


@pytest.mark.quick
def test_sigint_stops_attached_launch_and_detach_status_stop(ssh_cluster, project):
    env = ssh_cluster.env()
    args = nodectl_args(ssh_cluster, "launch", "--skip-preflight", "--gpus", "1", "--grace", "2", "--", "train.py",
                        env={"SLEEP": "120"})
    proc = subprocess.Popen([sys.executable, "-m", "nodectl", *args], env=env, cwd=project,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_id = wait_for(lambda: (project / "runs").is_dir() and any((project / "runs").iterdir())
                      and latest_run_id(project))
    try:
        wait_for(lambda: len(run_processes(run_id)) >= 4, timeout=60)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert run_processes(run_id) == []
        # what the stop did, as `stop` says it; the run's story is the interrupt, not its ranks' SIGTERM
        assert "node0: 2 process(es) stopped" in err and f"run {run_id} interrupted: 2 of 2 node(s) stopped, 0 " \
            f"process(es) left" in err, err
        status = run_nodectl(["status", "--run", run_id], env=env, cwd=project)
        assert "interrupted by the user" in status.stdout and "SIGTERM to nodectl" in status.stdout
        assert "killed by" not in status.stdout and "last lines" not in status.stdout, status.stdout
    finally:
        proc.kill()
        kill_leftovers(run_id)

    detached = run_nodectl(args[:-2] + ["--detach", "--", "train.py"], env=env, cwd=project)
    assert detached.exit_code == 0, detached.output
    run_id = latest_run_id(project)
    assert run_id in detached.stdout and "nodectl tail rank0 -f" in detached.stdout
    try:
        wait_for(lambda: "running" in json.dumps(run_nodectl(["--json", "status"], env=env, cwd=project).json()))
        stopped = run_nodectl(["stop", "--grace", "2"], env=env, cwd=project)
        assert stopped.exit_code == 0, stopped.output
        assert run_processes(run_id) == []
        again = run_nodectl(["stop"], env=env, cwd=project)  # idempotent
        assert again.exit_code == 0 and "0 process(es) stopped" in again.stderr
    finally:
        kill_leftovers(run_id)


STUBBORN = """\
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("holding on", flush=True)
time.sleep(600)
"""


def launched_and_holding_on(cluster, project, name: str, script: str) -> str:
    """`launch --detach` of a script on 2 nodes x 1 rank; returns the run id once both ranks said "holding on"."""
    env = cluster.env()
    (project / name).write_text(script)
    launched = run_nodectl(nodectl_args(cluster, "launch", "--skip-preflight", "--gpus", "1", "--detach", "--", name),
                           env=env, cwd=project)
    assert launched.exit_code == 0, launched.output
    run_id = latest_run_id(project)
    try:
        for rank in (0, 1):
            wait_for(lambda: "holding on" in run_nodectl(["tail", f"rank{rank}"], env=env, cwd=project).stdout)
    except AssertionError:
        kill_leftovers(run_id)
        raise
    return run_id


def test_ctrl_c_during_stop_kills_at_once_instead_of_waiting_out_the_grace(ssh_cluster, project):
    """Ranks that ignore SIGTERM, `stop --grace 120`, then Ctrl-C: the stop does not wait the two minutes (the
    node calls in flight used to be waited for); what is left gets SIGKILL now, the run is stopped, exit 130."""
    env = ssh_cluster.env()
    run_id = launched_and_holding_on(ssh_cluster, project, "stubborn.py", STUBBORN)
    try:
        stopping = subprocess.Popen([sys.executable, "-m", "nodectl", "stop", "--grace", "120"], env=env,
                                    cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(4)   # connected, SIGTERM sent, the nodes now wait out the grace
        assert stopping.poll() is None and len(run_processes(run_id)) >= 2
        pressed = time.time()
        stopping.send_signal(signal.SIGINT)
        out, err = stopping.communicate(timeout=60)
        assert time.time() - pressed < 30, err
        assert stopping.returncode == 130, out + err
        assert "SIGKILL without waiting out the grace period" in err
        assert run_processes(run_id) == []
        assert json.loads((project / "runs" / run_id / "manifest.json").read_text())["state"] == "stopped"
    finally:
        kill_leftovers(run_id)


SLOW_TO_SAVE = """\
import os, signal, sys, time
def save(signum, frame):
    time.sleep(5)   # a checkpoint that takes longer than the launch script's own 2 s for what escaped
    open(os.path.join(os.environ["NODECTL_RUN_DIR"], "output", f"saved{os.environ['RANK']}"), "w").write("ok")
    sys.exit(143)
os.makedirs(os.path.join(os.environ["NODECTL_RUN_DIR"], "output"), exist_ok=True)
signal.signal(signal.SIGTERM, save)
print("holding on", flush=True)
time.sleep(600)
"""


def test_stop_gives_the_ranks_the_whole_grace_period(ssh_cluster, project):
    """A rank that needs 5 s to save after SIGTERM finishes saving under `stop --grace 30`: the launch script
    waits for torchrun on SIGTERM instead of ending, and its exit trap's SIGKILL never cuts the save short."""
    env = ssh_cluster.env()
    run_id = launched_and_holding_on(ssh_cluster, project, "slow.py", SLOW_TO_SAVE)
    try:
        stopped = run_nodectl(["stop", "--grace", "30"], env=env, cwd=project)
        assert stopped.exit_code == 0, stopped.output
        assert stopped.stderr.count("0 needed SIGKILL") == 2, stopped.output
        for rank, node in enumerate(ssh_cluster.nodes[:2]):
            assert (node.workdir / "runs" / run_id / "output" / f"saved{rank}").read_text() == "ok"
    finally:
        kill_leftovers(run_id)


def test_two_runs_at_once_stop_one_leaves_the_other(ssh_cluster, project):
    env = ssh_cluster.env()
    base = nodectl_args(ssh_cluster, "launch", "--skip-preflight", "--gpus", "1", "--detach", "--", "train.py",
                        env={"SLEEP": "120"})
    first = run_nodectl(base, env=env, cwd=project)
    time.sleep(1.1)  # run ids carry the second they started
    second = run_nodectl(base, env=env, cwd=project)
    assert first.exit_code == 0 and second.exit_code == 0, first.output + second.output
    run_a, run_b = sorted(p.name for p in (project / "runs").iterdir())[-2:]
    second_states = json.loads((project / "runs" / run_b / "manifest.json").read_text())["node_states"]
    assert {state["bytes_sent"] for state in second_states.values()} == {0}  # unchanged files are not re-sent
    try:
        wait_for(lambda: len(run_processes(run_a)) >= 4 and len(run_processes(run_b)) >= 4)
        assert run_nodectl(["stop", "--run", run_a, "--grace", "2"], env=env, cwd=project).exit_code == 0
        assert run_processes(run_a) == []
        assert len(run_processes(run_b)) >= 4
    finally:
        kill_leftovers(run_a)
        kill_leftovers(run_b)


def test_builtin_local_default_two_local_nodes(project):
    env = {**os.environ, "NODECTL_FORCE_CPU": "1", "PYTHONUNBUFFERED": "1", "HOME": str(project.parent / "home")}
    result = run_nodectl(["launch", "--nodes", "2", "--gpus", "1", "--skip-preflight", "--", "train.py"],
                         env=env, cwd=project)
    assert result.exit_code == 0, result.output
    assert "rank=0 world=2 node=0 sum=3" in result.stdout
    tail = run_nodectl(["tail", "rank1"], env=env, cwd=project)
    assert "rank=1 world=2 node=1" in tail.stdout


def test_dry_run_touches_nothing_and_hides_secrets(ssh_cluster, project):
    result = run_nodectl(nodectl_args(ssh_cluster, "launch", "--dry-run", "--", "train.py",
                                      env={"HF_TOKEN": "hf_dry_canary", "NCCL_DEBUG": "WARN"}),
                         env=ssh_cluster.env(), cwd=project)
    assert result.exit_code == 0, result.output
    assert "--node-rank=1" in result.stdout and "NCCL_DEBUG=WARN" in result.stdout
    assert "hf_dry_canary" not in result.output and "HF_TOKEN='***'" in result.stdout
    assert not (project / "runs").exists()


def test_script_outside_sync_dir_is_a_usage_error(project):
    result = run_nodectl(["launch", "--dry-run", "--", "missing.py"], cwd=project,
                         env={**os.environ, "NODECTL_FORCE_CPU": "1"})
    assert result.exit_code == 2 and "missing.py" in result.stderr and "Traceback" not in result.output
