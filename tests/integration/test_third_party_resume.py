"""A third-party trainer resumes across isolated nodes: Hugging Face's Trainer writes a checkpoint's weights on
global rank 0 only, so node1's copy of `checkpoint-10` holds just its ranks' rng states. $NODECTL_OUTPUT_DIR is
seen by every rank all the same: before a resumed attempt starts, what node 0's output/ holds and another node
lacks is added there, and each node keeps what it wrote itself. `collect` brings back what a script wrote in its
own folder and says so. The goodput ledger sees its checkpoints and steps without a change to it."""
from __future__ import annotations

import shutil

import pytest

from support import REPO

from support.cli import run_nodectl

from support.sshcluster import running_cluster
from support.launch import latest_run_id, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory, 2, first_octet=80) as cluster:
        yield cluster


def test_hf_trainer_stopped_then_resumed_on_two_isolated_nodes(cluster, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(REPO / "tests" / "data" / "scripts" / "hf_trainer.py", project / "train.py")
    env = cluster.env(NODECTL_INVENTORY=str(cluster.inventory()))
    started = run_nodectl(["launch", "--skip-preflight", "--detach", "--", "train.py", "--steps", "15",
                           "--hold-at", "10"], env=env, cwd=project)
    assert started.exit_code == 0, started.output
    run_id = latest_run_id(project)
    node0, node1 = (node.workdir / "runs" / run_id / "output" / "checkpoint-10" for node in cluster.nodes)
    wait_for(lambda: (node0 / "trainer_state.json").exists() and (node1 / "rng_state_1.pth").exists(), timeout=120)
    wait_for(lambda: (cluster.nodes[0].workdir / "runs" / run_id / "output" / "checkpoint-15").exists() or
             "at step 11" in run_nodectl(["tail", "rank0", "--run", run_id], env=env, cwd=project).stdout,
             timeout=60)
    stopped = run_nodectl(["stop", "--run", run_id], env=env, cwd=project)
    assert stopped.exit_code == 0, stopped.output
    assert not (node1 / "model.safetensors").exists(), "transformers writes the weights on rank 0 only"
    own_rng = (node1 / "rng_state_1.pth").read_bytes()

    resumed = run_nodectl(["launch", "--resume", run_id], env=env, cwd=project, timeout=300)
    assert resumed.exit_code == 0, resumed.output
    assert "resume from: checkpoint-10" in resumed.stdout and "finished at global step 15" in resumed.stdout
    rank1 = run_nodectl(["tail", "rank1", "--run", run_id], env=env, cwd=project)
    assert "resume from: checkpoint-10" in rank1.stdout and "finished at global step 15" in rank1.stdout
    assert (node1 / "model.safetensors").is_file() and (node1 / "optimizer.pt").is_file()
    assert (node1 / "rng_state_1.pth").read_bytes() == own_rng, "a node keeps what it wrote itself"

    collected = run_nodectl(["collect", "--run", run_id], env=env, cwd=project)
    assert collected.exit_code == 0, collected.output
    home = project / "runs" / run_id / "nodes"
    assert (home / "node0" / "output" / "checkpoint-15" / "model.safetensors").is_file()
    assert (home / "node1" / "output" / "checkpoint-10" / "rng_state_1.pth").is_file()
    assert not (home / "node0" / "code" / "train.py").exists(), "the synced project stays on the node"

    # the goodput ledger sees the unchanged script's checkpoints and steps (lib/framework_phases.py wraps
    # transformers' Trainer) and names the one kind it cannot see
    listed = run_nodectl(["--json", "runs"], env=env, cwd=project).json()["runs"]
    ledger = next(r for r in listed if r["run_id"] == run_id)["goodput"]
    assert ledger["lost_s"]["checkpoints"] > 0, ledger
    # (attempt 0 ran detached, with no watch to see its first step: the ledger says so too)
    assert [u for u in ledger["unseen"] if "first step" not in u] == [
        "data waits (transformers.Trainer does not say when they happen; nodectl_metrics.phase marks them)"], ledger
    resumed_attempt = ledger["attempts"][-1]
    assert resumed_attempt["first_step"] is not None and resumed_attempt["continued_from"] == 10, ledger


def test_collect_brings_back_what_a_script_wrote_in_its_folder(cluster, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("import os\nos.makedirs('out/ckpt', exist_ok=True)\n"
                                      "open('out/ckpt/weights.bin', 'wb').write(b'w' * 100)\n"
                                      "open('notes.txt', 'w').write('rank ' + os.environ['RANK'])\n")
    env = cluster.env(NODECTL_INVENTORY=str(cluster.inventory()))
    done = run_nodectl(["launch", "--skip-preflight", "--", "train.py"], env=env, cwd=project)
    assert done.exit_code == 0, done.output
    run_id = latest_run_id(project)
    collected = run_nodectl(["collect", "--run", run_id], env=env, cwd=project)
    assert collected.exit_code == 0, collected.output
    assert "2 file(s) the program wrote there, brought back" in collected.stderr + collected.stdout
    assert "request" not in collected.stderr, "nodectl's own FIFOs are no warning"
    for node, rank in (("node0", 0), ("node1", 1)):
        code = project / "runs" / run_id / "nodes" / node / "code"
        assert (code / "out" / "ckpt" / "weights.bin").read_bytes() == b"w" * 100
        assert (code / "notes.txt").read_text() == f"rank {rank}"
        assert not (code / "train.py").exists()
