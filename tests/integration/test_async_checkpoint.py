"""train.async_checkpoint: the built-in trainer writes its checkpoints in a thread while it trains (gloo ranks under
torchrun; a disk slowed by NODECTL_TEST_SLOW_CHECKPOINT_WRITE so that the write outlasts steps)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from support import REPO
from support.trainer import free_port, metrics, torchrun

pytestmark = pytest.mark.slow

# FSDP's shards (DTensors): the whole copy is gathered by every rank and kept by the first
COMMON = ("train.steps=8", "train.log_every=1", "train.checkpoint_every=2", "train.keep_checkpoints=5",
          "model.parallelism=fsdp")


def _losses(out) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in metrics(out) if "loss" in m}


def test_training_goes_on_while_a_checkpoint_is_written_a_kill_mid_write_leaves_it_incomplete_and_resume_is_exact(
        tmp_path, demo_cache, monkeypatch):
    reference = torchrun(2, tmp_path / "sync", demo_cache, *COMMON, "train.async_checkpoint=false")
    assert reference.returncode == 0, reference.stderr[-2000:]

    # each write takes 3 s; rank 0 dies in step 6's write, its files written, before COMPLETE
    monkeypatch.setenv("NODECTL_TEST_SLOW_CHECKPOINT_WRITE", "3")
    monkeypatch.setenv("NODECTL_TEST_CRASH_IN_CHECKPOINT", "6")
    out = tmp_path / "async"
    crashed = torchrun(2, out, demo_cache, *COMMON, "train.async_checkpoint=true")
    assert crashed.returncode != 0
    records = metrics(out)
    saved = {r["step"]: (r["checkpoint_s"], r["checkpoint_write_s"], i) for i, r in enumerate(records)
             if "checkpoint_write_s" in r}
    assert set(saved) == {2, 4}, records   # step 6's never ended
    for step, (waited, written, _) in saved.items():
        assert written >= 3 and waited < 1.5, (step, waited, written)   # training waited for the staging only
    steps_logged = [r["step"] for r in records[:saved[2][2]] if "loss" in r]
    assert 3 in steps_logged, f"step 3 trained while step 2's checkpoint was written: {records}"
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("ckpt-*")) == ["ckpt-0000002", "ckpt-0000004"]
    assert not (checkpoints / "ckpt-0000006").exists() and all((p / "COMPLETE").exists()
                                                               for p in checkpoints.glob("ckpt-*"))
    assert json.loads((checkpoints / "ckpt-0000004" / "COMPLETE").read_text())["world_size"] == 2

    monkeypatch.delenv("NODECTL_TEST_CRASH_IN_CHECKPOINT")
    monkeypatch.delenv("NODECTL_TEST_SLOW_CHECKPOINT_WRITE")
    resumed = torchrun(2, out, demo_cache, *COMMON, "train.async_checkpoint=true")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming at step 4" in resumed.stdout
    same, ran = _losses(tmp_path / "sync"), _losses(out)
    assert [ran[s] for s in range(5, 9)] == [same[s] for s in range(5, 9)], (ran, same)   # to the last bit
    assert (checkpoints / "ckpt-0000008" / "COMPLETE").exists(), "the end waits for the last write"


def test_sigterm_waits_for_the_checkpoint_being_written_before_the_rank_exits(tmp_path, demo_cache):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "NODECTL_DEMO_CACHE": str(demo_cache), "OMP_NUM_THREADS": "1",
           "NODECTL_TEST_SLOW_CHECKPOINT_WRITE": "3"}
    env.pop("NODECTL_RUN_DIR", None)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", "-m", "trainer"]
    for assignment in (f"train.output_dir={out}", "train.steps=500", "train.log_every=1", "train.checkpoint_every=3",
                       "train.keep_checkpoints=20", "train.async_checkpoint=true"):
        argv += ["--set", assignment]
    agent = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             cwd=tmp_path, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(r.get("step", 0) >= 4 and "loss" in r for r in
                                                      (metrics(out) if (out / "metrics.jsonl").exists() else [])):
            time.sleep(0.2)
        os.killpg(agent.pid, signal.SIGTERM)    # a write (3 s each) is in flight, or the next one soon
        said, _ = agent.communicate(timeout=120)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
    stopped = [r for r in metrics(out) if r.get("stop") == "SIGTERM"]
    assert stopped, said[-2000:]
    step = stopped[0]["step"]
    complete = sorted(p.name for p in (out / "checkpoints").glob("ckpt-*") if (p / "COMPLETE").exists())
    # every checkpoint the run began is complete, the stop's own last: the rank waited for them before it exited
    assert complete == [f"ckpt-{s:07d}" for s in range(3, step, 3)] + [f"ckpt-{step:07d}"] * (step % 3 != 0) or \
        complete == [f"ckpt-{s:07d}" for s in range(3, step + 1, 3)], (complete, said[-2000:])
    assert not list((out / "checkpoints").glob(".ckpt-*.tmp"))
