"""A full disk, wherever it fills: on a node during a checkpoint (a clear error on every rank, no hang, the
previous checkpoint intact and resumable) or while runctl unpacks uv; on the controller while `collect` unpacks
or env-dump writes. Each case gets a tmpfs of its own size (`small_disk`)."""
from __future__ import annotations

import errno
import hashlib
import io
import os
import re
import subprocess
import sys
import tarfile
import zipfile

import pytest

from nodectl.remote.collect import unpack
from nodectl.resources import resource_dir
from support.cli import run_nodectl
from support.trainer import metrics, torchrun

sys.path.insert(0, str(resource_dir("launchers")))
import runctl  # noqa: E402


@pytest.fixture
def small_disk(tmp_path):
    """small_disk(size) -> a folder on a tmpfs of that size (tmpfs's units: 64k, 1m), unmounted after the test."""
    mounted = []

    def make(size: str):
        folder = tmp_path / f"small-{len(mounted)}"
        folder.mkdir()
        if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                                               capture_output=True).returncode:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        mounted.append(folder)
        return folder

    yield make
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


@pytest.mark.slow
def test_disk_full_in_a_checkpoint_keeps_the_previous_one(demo_cache, small_disk):
    disk = small_disk("1100k")
    common = ("train.steps=20", "train.log_every=5", "train.checkpoint_every=5", "train.keep_checkpoints=5",
              "train.collective_timeout_s=60")
    out = disk / "out"
    full = torchrun(2, out, demo_cache, *common, timeout=180)
    assert full.returncode != 0
    output = full.stdout + full.stderr
    # foreseen after the checkpoint that left too little room, then refused before a byte of the next is written,
    # with the figures (it was a zip writer's "unexpected pos 8857505664 vs 8857505564")
    assert re.search(r"warning: no space left on node \S+ for the next checkpoint: it needs [0-9.]+ MB \(the last "
                     r"one's size\), [0-9.]+ MB free under \S+; free space, lower train.keep_checkpoints or set "
                     r"train.make_room: true before then", output), output[-3000:]
    assert re.search(r"checkpoint error: rank 0: no space left on node \S+ for the checkpoint at step \d+: it needs "
                     r"[0-9.]+ MB \(the last one's size\), [0-9.]+ MB free", output), output[-3000:]
    assert "the previous complete checkpoint is intact" in output and "unexpected pos" not in output
    # the warning rides on rank 0's heartbeat, which `status` shows under its table (rank 0 on NODE: warning: ...)
    import json

    from nodectl.cli.status import _rank_state
    from nodectl.remote.answers import PollAnswer, RankState

    beat = json.loads((out / "heartbeat" / "rank0.json").read_text())
    assert beat["warning"].startswith("warning: no space left on node"), beat
    row = _rank_state(RankState(rank=0, alive=True, heartbeat=beat, heartbeat_age=1.0),
                      PollAnswer(now=0, node_rank=0, alive=1, ranks=()), 60)
    assert row["warning"] == beat["warning"]
    complete = sorted(p.name for p in (out / "checkpoints").glob("ckpt-*"))
    assert complete and not list((out / "checkpoints").glob(".ckpt-*.tmp"))
    subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
    resumed = torchrun(2, out, demo_cache, *common)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming at step {int(complete[-1].split('-')[1])}" in resumed.stdout


@pytest.mark.slow
def test_a_disk_that_fills_during_a_background_write_is_named_and_every_rank_stops(demo_cache, small_disk):
    """train.async_checkpoint: the first checkpoint (nothing foreseen yet) fills the disk in the writing thread;
    every rank learns it at the next logging step and the run ends with the figures, no half checkpoint left."""
    disk = small_disk("300k")
    out = disk / "out"
    full = torchrun(2, out, demo_cache, "train.steps=12", "train.log_every=1", "train.checkpoint_every=4",
                    "train.async_checkpoint=true", "train.collective_timeout_s=60", timeout=180)
    output = full.stdout + full.stderr
    assert full.returncode != 0, output[-3000:]
    assert re.search(r"checkpoint error: (rank \d+: )?(checkpoint at step 4 could not be written to \S+ \()?rank \d+: "
                     r"no space left on node \S+ for the checkpoint at step 4: [0-9.]+ MB free under \S+ once "
                     r"[0-9.]+ MB of it were written", output), output[-3000:]
    assert "the previous complete checkpoint is intact" in output and " failed:\n" not in output, output[-3000:]
    assert not list((out / "checkpoints").glob("*ckpt-*")), "nothing of the failed checkpoint is left"
    steps = [m["step"] for m in metrics(out) if "loss" in m]
    assert max(steps) < 12, "the run stopped on it"


@pytest.mark.slow
def test_make_room_drops_the_oldest_checkpoints_never_the_newest_and_the_run_ends(demo_cache, small_disk):
    """train.make_room: the same small disk, and the run completes: each checkpoint that would not fit removes
    the oldest kept ones first; the newest complete one always stays. (This disk holds two of the five kept.)"""
    disk = small_disk("2300k")
    out = disk / "out"
    done = torchrun(2, out, demo_cache, "train.steps=20", "train.log_every=5", "train.checkpoint_every=5",
                    "train.keep_checkpoints=5", "train.make_room=true", "train.collective_timeout_s=60",
                    timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    kept = sorted(p.name for p in (out / "checkpoints").glob("ckpt-*"))
    assert kept and kept[-1] == "ckpt-0000020" and len(kept) < 5, kept
    assert "no space left" not in done.stdout + done.stderr


def test_a_full_disk_while_uv_is_unpacked_names_the_folder_and_leaves_nothing(tmp_path, small_disk):
    """The audit's case: ENOSPC in the middle of unpacking uv said "OSError: [Errno 28]" with no path and left a
    partial uv-<sha>.<pid>.tmp behind."""
    store = tmp_path / "store"
    store.mkdir()
    wheel = store / "uv.whl"
    with zipfile.ZipFile(wheel, "w") as archive:   # a uv wheel's layout, 3 MiB of binary
        archive.writestr("uv-0.9.0.data/scripts/uv", os.urandom(3 << 20))
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    wheel.rename(store / sha)
    workdir = small_disk("1m")
    with pytest.raises(RuntimeError) as caught:
        runctl.envs._uv_binary(str(workdir), str(store), {"sha256": sha})
    said = str(caught.value)
    assert f"{workdir}/.nodectl/tools" in said and "No space left on device" in said and "MiB free there" in said
    assert list((workdir / ".nodectl" / "tools").iterdir()) == []


def test_a_full_local_disk_is_a_message_not_a_traceback(tmp_path, small_disk):
    full = small_disk("16k")
    env = {**os.environ, "HOME": str(tmp_path), "NODECTL_FORCE_CPU": "1"}
    result = run_nodectl(["env-dump", "--nodes", "3", "-o", str(full)], env=env, cwd=tmp_path)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output[-1500:]
    assert "the local disk is full" in result.stderr


def test_a_full_disk_while_collecting_leaves_no_truncated_file(tmp_path, small_disk):
    """The audit's full controller disk during `collect`: a truncated weights.bin was left, unmarked, looking like
    the node's. Each file is now written under a temporary name and renamed only when whole."""
    target = small_disk("64k")
    archive = tmp_path / "pack.tar"
    with tarfile.open(archive, "w") as tar:
        for name, size in (("logs/rank0.log", 1000), ("output/weights.bin", 1 << 20)):
            info = tarfile.TarInfo(name)
            info.size = size
            tar.addfile(info, io.BytesIO(b"w" * size))
    with pytest.raises(OSError) as caught:
        unpack(archive, target / "run")
    assert caught.value.errno == errno.ENOSPC
    assert (target / "run" / "logs" / "rank0.log").stat().st_size == 1000
    assert sorted(p.name for p in (target / "run" / "output").iterdir()) == []   # nothing half-written


def test_a_full_disk_while_pip_builds_an_environment_names_the_disk_and_the_folder(tmp_path, small_disk):
    """The audit's third full disk: a pip-built environment (a node without uv) failed with pip's last line,
    naming neither the disk nor the folder. Nothing of the half-built venv is kept."""
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                           "six==1.17.0", "-d", str(tmp_path / "wheels")], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"no package index here: {proc.stderr[-300:]}")
    wheel = next((tmp_path / "wheels").glob("six-*.whl"))
    workdir = small_disk("3m")   # room for the wheel, not for a venv with its own pip
    store = workdir / ".nodectl" / "objects"
    store.mkdir(parents=True)
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    (store / sha).write_bytes(wheel.read_bytes())
    with pytest.raises(RuntimeError) as caught:
        runctl.envs.cmd_env_build([str(workdir)], {"lock_sha": "3" * 64, "wheels": [{"name": wheel.name,
                                                                                      "sha256": sha}]})
    said = str(caught.value)
    assert f"building the venv in {workdir}/.nodectl/envs/" in said and "the disk is full" in said, said
    assert "MiB free there" in said
    assert [p.name for p in (workdir / ".nodectl" / "envs").iterdir() if not p.name.endswith(".lock")] == []
