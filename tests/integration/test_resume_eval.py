"""Exact resume, checkpoint crash safety, deterministic eval, plateau early stop, and the report."""
from __future__ import annotations

import json
import os
import signal

import psutil
import pytest
import torch

from support.cli import run_nodectl
from support.launch import kill_leftovers, wait_for
from support.trainer import demo_folder, torchrun
from support.trainer_import import trainer_module

pytestmark = pytest.mark.slow
RECIPE = """\
data: {path: demo, max_length: 64}
lora: {dropout: 0.1, target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head]}
train: {steps: 20, log_every: 1, checkpoint_every: 5, collective_timeout_s: 60}
"""


def losses(path):
    by_step = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            by_step[record["step"]] = record["loss"]  # a resumed run logs some steps twice: the last counts
    return by_step


def trainer_pid(run_id: str, rank: int):
    for proc in psutil.process_iter():
        try:
            env, argv = proc.environ(), proc.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if env.get("NODECTL_RUN_ID") == run_id and env.get("RANK") == str(rank) and "nodectl_trainer" in argv \
                and not any("rankexec" in a for a in argv):
            return proc
    return None


@pytest.mark.timeout(600)   # four launches in a row: 150-220 s alone, over 300 beside another file on 2 cores
def test_kill9_a_rank_then_resume_logs_the_same_losses_and_report(ssh_cluster, tmp_path, demo_cache):
    project = tmp_path / "project"
    project.mkdir()
    (project / "recipe.yaml").write_text(RECIPE)
    env = ssh_cluster.env()
    inventory = ssh_cluster.inventory(count=2, env={"NODECTL_DEMO_CACHE": str(demo_cache)})
    base = ["-i", str(inventory), "launch", "--skip-preflight", "--config", "recipe.yaml"]

    straight = run_nodectl(base, env=env, cwd=project, timeout=300)
    assert straight.exit_code == 0, straight.output[-2000:]
    run_a = sorted(p.name for p in (project / "runs").iterdir() if p.name[0].isdigit())[-1]
    # two nodes of one kernel, no OMP_NUM_THREADS (nothing probed them): their ranks share its CPUs, where each
    # used to start a thread per core and spin against the other
    summary = json.loads((ssh_cluster.nodes[0].workdir / "runs" / run_a / "output" / "summary.json").read_text())
    assert summary["threads"] == max(1, min(8, len(os.sched_getaffinity(0)) // 2)), summary

    # Run B: rank 1 is killed with SIGKILL at step 12 (its last complete checkpoint is at step 10); --max-restarts makes nodectl stop the run everywhere and
    # start it again as attempt 1, which continues from the latest complete checkpoint.
    import subprocess
    import sys

    attached = subprocess.Popen([sys.executable, "-m", "nodectl", *base, "--max-restarts", "1"], env=env, cwd=project,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_b = wait_for(lambda: next((p.name for p in (project / "runs").iterdir() if p.name[0].isdigit()
                                   and p.name != run_a), None))
    heartbeat = ssh_cluster.nodes[1].workdir / "runs" / run_b / "heartbeat" / "rank1.json"
    try:
        wait_for(lambda: heartbeat.exists() and json.loads(heartbeat.read_text())["step"] >= 12, timeout=120,
                 interval=0.05)
        trainer_pid(run_b, 1).send_signal(signal.SIGKILL)
        out, err = attached.communicate(timeout=300)
        assert attached.returncode == 0, err[-3000:]
        assert "restarting run" in err and "rank 1 on node node1 failed (killed by SIGKILL)" in err
        # what the restart costs, said before it: the checkpoint it continues from (the one the trainer then
        # resumed from), and the steps done again
        import re

        said = re.search(r"attempt 1 continues from step (\d+), the newest checkpoint every node of it holds "
                         r"\(the last attempt reached step (\d+)\); (\d+) step\(s\) are done again", err)
        assert said, err[-3000:]
        kept, reached, redone = map(int, said.groups())
        assert kept % 5 == 0 and reached >= 12 and redone == reached - kept > 0, said[0]
        assert f"resuming at step {kept}" in out, out[-2000:]
        assert "resuming at step" in out
    finally:
        attached.kill()
        kill_leftovers(run_b)
    node_dir = ssh_cluster.nodes[0].workdir / "runs" / run_b
    assert (node_dir / "attempts" / "0" / "logs" / "rank0.log").is_file()
    a = losses(ssh_cluster.nodes[0].workdir / "runs" / run_a / "output" / "metrics.jsonl")
    b = losses(node_dir / "output" / "metrics.jsonl")
    assert sorted(a) == sorted(b) == list(range(1, 21))
    assert [a[s] for s in range(1, 21)] == [b[s] for s in range(1, 21)]  # bit for bit, resume point included
    manifest = json.loads((project / "runs" / run_b / "manifest.json").read_text())
    assert manifest["attempt"] == 1 and manifest["state"] == "succeeded"
    assert manifest["attempts"][0]["state"] == "failed" and manifest["attempts"][0]["failure"]["rank"] == 1

    # Train a finished run further: --resume with a recipe override continues from its last checkpoint.
    more = run_nodectl(["-i", str(inventory), "launch", "--skip-preflight", "--resume", run_b, "--set",
                        "train.steps=23"], env=env, cwd=project, timeout=300)
    kill_leftovers(run_b)
    assert more.exit_code == 0, more.output[-2000:]
    assert "resuming at step 20" in more.stdout
    assert sorted(losses(node_dir / "output" / "metrics.jsonl")) == list(range(1, 24))
    assert json.loads((project / "runs" / run_b / "manifest.json").read_text())["plan"]["overrides"] == \
        ["train.steps=23"]

    assert run_nodectl(["collect", "--run", run_b], env=env, cwd=project).exit_code == 0
    report = run_nodectl(["--json", "report", "--run", run_b], env=env, cwd=project)
    assert report.exit_code == 0, report.output
    document = report.json()
    assert document["summary"]["steps"] == 23 and document["summary"]["end_reason"] == "completed 23 steps"
    import matplotlib.image

    image = matplotlib.image.imread(project / "runs" / run_b / "report" / "loss.png")
    assert image.shape[:2] == (450, 800) and image.std() > 0.01
    assert (project / "runs" / run_b / "report" / "step_time.png").is_file()
    assert not list((project / "runs" / run_b / "nodes").glob("*/metrics/telemetry.jsonl"))  # no NVML on CPU: no file


def test_a_checkpoint_continues_on_fewer_ranks_from_its_replica(tmp_path, demo_cache):
    """What --exclude-failed needs: a node (and its shards) gone, the run goes on with the ranks that are left."""
    common = ("train.log_every=1", "train.checkpoint_every=5", "lora.dropout=0.1")
    two = torchrun(2, tmp_path / "out", demo_cache, "train.steps=10", *common)
    assert two.returncode == 0, two.stderr[-2000:]
    assert (tmp_path / "out" / "checkpoints" / "ckpt-0000010" / "replica.pt").is_file()
    one = torchrun(1, tmp_path / "out", demo_cache, "train.steps=20", *common)
    assert one.returncode == 0, one.stderr[-2000:]
    assert "checkpoint of 2 ranks resharded to 1" in one.stdout and "resuming at step 10" in one.stdout
    steps = losses(tmp_path / "out" / "metrics.jsonl")
    assert sorted(steps) == list(range(1, 21))
    assert steps[11] < steps[1] * 0.9  # it continued training, not from the initial adapter


def test_eval_subset_is_fixed_its_loss_matches_one_process_and_a_plateau_stops_every_rank_at_once(tmp_path,
                                                                                                   demo_cache):
    """One run proves both (they were two runs): the eval at start over a fixed subset of the held-out rows gives
    Hugging Face's own loss of the base on those rows, and a plateau (no eval better by min_delta) ends training
    at the same step on every rank: with patience 1, after the second eval of training (step 4; the eval at start
    is not one of them)."""
    sets = ("train.steps=50", "train.eval_every=2", "train.eval_at_start=true", "data.eval_holdout=200",
            "data.eval_samples=24", "train.micro_batch_size=5", "train.early_stop_patience=1",
            "train.early_stop_min_delta=100")
    proc = torchrun(2, tmp_path / "out", demo_cache, *sets)
    assert proc.returncode == 0, proc.stderr[-2000:]
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    at_start = next(r["eval_loss"] for r in logged if r.get("eval_loss") is not None and r["step"] == 0)

    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["end_reason"].startswith("plateau"), summary
    beats = [json.loads((tmp_path / "out" / "heartbeat" / f"rank{r}.json").read_text())["step"] for r in (0, 1)]
    assert beats == [4, 4]
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    data, evaluate = trainer_module("data"), trainer_module("evaluate")
    model_dir = demo_folder(demo_cache) / "model"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    examples = data.load_examples(demo_folder(demo_cache) / "train.jsonl", tokenizer, 64, False)
    _, held = evaluate.split(examples, 200, 0)
    subset = evaluate.eval_subset(held, 24, 0)
    assert subset == evaluate.eval_subset(held, 24, 0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = data.collate(subset, tokenizer.pad_token_id)
    with torch.no_grad():  # Hugging Face's own mean next-token loss over the same rows
        expected = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         labels=batch["labels"]).loss
    assert at_start == pytest.approx(expected.item(), rel=1e-5)  # LoRA B starts at zero: the base's loss


def test_a_restart_without_a_checkpoint_starts_again_and_a_run_without_checkpoint_settings_resumes_from_its_end(
        tmp_path, demo_cache, monkeypatch):
    """Attempt 0 writes no checkpoint (train.checkpoint_minutes=0): attempt 1 says it cannot continue, keeps the
    previous adapter and starts again from step 0. Attempt 1 has the demo recipe's settings (no checkpoint_every):
    the end-of-run checkpoint (on by default, with the timed ones) lets the next attempt with more steps (`launch
    --resume RUN --set train.steps=MORE`) continue instead of starting again from step 0."""
    out = tmp_path / "out"
    first = torchrun(1, out, demo_cache, "train.steps=3", "train.checkpoint_minutes=0")
    assert first.returncode == 0, first.stderr[-2000:]
    assert not (out / "checkpoints").exists()
    previous = (out / "adapter" / "adapter_model.safetensors").read_bytes()
    monkeypatch.setenv("NODECTL_ATTEMPT", "1")
    again = torchrun(1, out, demo_cache, "train.steps=6", "train.log_every=1", "lora.dropout=0.2")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "attempt 1: no checkpoint" in again.stdout and "starts again from step 0" in again.stdout
    assert (out / "previous-attempt-0" / "adapter_model.safetensors").read_bytes() == previous
    assert (out / "adapter" / "adapter_model.safetensors").read_bytes() != previous
    assert (out / "checkpoints" / "ckpt-0000006").is_dir()
    monkeypatch.setenv("NODECTL_ATTEMPT", "2")
    more = torchrun(1, out, demo_cache, "train.steps=9", "train.log_every=1", "lora.dropout=0.2")
    assert more.returncode == 0, more.stderr[-2000:]
    assert "resuming at step 6" in more.stdout
    assert sorted(losses(out / "metrics.jsonl")) == list(range(1, 10))
