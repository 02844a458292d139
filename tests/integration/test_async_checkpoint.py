"""train.async_checkpoint: the built-in trainer writes its checkpoints in a thread while it trains (gloo ranks under
torchrun; a disk slowed by NODECTL_TEST_SLOW_CHECKPOINT_WRITE so that the write outlasts steps)."""
from __future__ import annotations

import json

import pytest

from support.trainer import metrics, torchrun

pytestmark = pytest.mark.slow

# FSDP's shards (DTensors): the whole copy is gathered by every rank and kept by the first
# dropout: the RNG states travel with the checkpoint too
COMMON = ("train.steps=8", "train.log_every=1", "train.checkpoint_every=2", "train.keep_checkpoints=5",
          "model.parallelism=fsdp", "lora.dropout=0.1")


def _losses(out) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in metrics(out) if "loss" in m}


def test_training_goes_on_while_a_checkpoint_is_written_a_kill_mid_write_leaves_it_incomplete_and_resume_is_exact(
        tmp_path, demo_cache, monkeypatch):
    """A checkpoint whose write is killed is never taken as complete, in the background or in place (the same
    write and COMPLETE marker; the in-place kill was test_resume_eval's own test); the run resumed in place from the
    one before gives the losses of a run never stopped, to the last bit."""
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
    assert saved[2][0] < 1.5, saved             # training waited for the staging only
    for step, (waited, written, _) in saved.items():
        # at most for the write before (steps 3-4 may be quicker than it), then staging
        assert written >= 3 and waited < 3 + 1.5, (step, waited, written)
    steps_logged = [r["step"] for r in records[:saved[2][2]] if "loss" in r]
    assert 3 in steps_logged, f"step 3 trained while step 2's checkpoint was written: {records}"
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("ckpt-*")) == ["ckpt-0000002", "ckpt-0000004"]
    assert not (checkpoints / "ckpt-0000006").exists() and all((p / "COMPLETE").exists()
                                                               for p in checkpoints.glob("ckpt-*"))
    assert (checkpoints / ".ckpt-0000006.tmp").is_dir()   # rank 0's part written, never marked
    assert json.loads((checkpoints / "ckpt-0000004" / "COMPLETE").read_text())["world_size"] == 2

    monkeypatch.delenv("NODECTL_TEST_CRASH_IN_CHECKPOINT")
    monkeypatch.delenv("NODECTL_TEST_SLOW_CHECKPOINT_WRITE")
    resumed = torchrun(2, out, demo_cache, *COMMON, "train.async_checkpoint=false")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming at step 4" in resumed.stdout
    same, ran = _losses(tmp_path / "sync"), _losses(out)
    assert [ran[s] for s in range(5, 9)] == [same[s] for s in range(5, 9)], (ran, same)   # to the last bit
    assert (checkpoints / "ckpt-0000008" / "COMPLETE").exists()
