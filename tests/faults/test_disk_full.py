"""A full disk during a checkpoint: a clear error on every rank, no hang, the previous checkpoint intact and
resumable."""
from __future__ import annotations

import subprocess

import pytest

from trainer_helpers import torchrun

pytestmark = pytest.mark.slow


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1100k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_disk_full_in_a_checkpoint_keeps_the_previous_one(tmp_path, demo_cache, small_disk):
    common = ("train.steps=20", "train.log_every=5", "train.checkpoint_every=5", "train.keep_checkpoints=5",
              "train.collective_timeout_s=60")
    out = small_disk / "out"
    full = torchrun(2, out, demo_cache, *common, timeout=180)
    assert full.returncode != 0
    output = full.stdout + full.stderr
    assert "checkpoint error: checkpoint at step" in output and "the previous complete checkpoint is intact" in output
    complete = sorted(p.name for p in (out / "checkpoints").glob("ckpt-*"))
    assert complete and not list((out / "checkpoints").glob(".ckpt-*.tmp"))
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    resumed = torchrun(2, out, demo_cache, *common)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming at step {int(complete[-1].split('-')[1])}" in resumed.stdout
