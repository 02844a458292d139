"""The throughput bench's two sides agree: the plain FSDP2 + peft reference script (bench/common/ref_plain_lora.py) and
the built-in trainer launched by nodectl, on the same data and seed, give the same losses step by step. This is
the CPU version of the loss-curve comparison the GPU figures rest on (docs/PERFORMANCE.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support import REPO

pytestmark = pytest.mark.slow


def test_reference_script_and_nodectl_trainer_give_the_same_losses(tmp_path):
    env = {**os.environ, "NODECTL_FORCE_CPU": "1", "NODECTL_DEMO_CACHE": str(tmp_path / "demo"),
           "HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    (tmp_path / "home").mkdir()
    out = tmp_path / "figures.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "trainer" / "gpu_train.py"), "--work", str(tmp_path / "work"),
                           "--tiny", "--parts", "ref,ref-noac,2x1", "--steps", "6", "--seq", "96", "--examples", "48",
                           "--micro", "2", "--compile", "false", "--checkpoint-every", "0", "--lr", "3e-3",
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["ref"]["exit"] == 0 and figures["2x1"]["exit"] == 0, proc.stdout[-3000:]
    ref = [s["loss"] for s in figures["ref"]["steps"]]
    ours = [s["loss"] for s in figures["2x1"]["steps"]]
    assert len(ref) == len(ours) == 6
    assert ref[-1] < ref[0] - 0.05  # it learns: the comparison is not between two flat lines
    for step, (a, b) in enumerate(zip(ref, ours), start=1):
        assert b == pytest.approx(a, abs=2e-3), f"step {step}: reference {a}, nodectl {b}"
    assert "loss, reference vs 2x1 over 6 steps" in proc.stdout
    noac = [s["loss"] for s in figures["ref-noac"]["steps"]]
    assert noac == pytest.approx(ref, abs=1e-4)  # checkpointing changes memory and time, not the losses
    rows = [line for line in proc.stdout.splitlines() if "by gaps" in line and "exit 0" in line]
    assert len(rows) == 3  # every run is shown both as reported and by wall-clock gaps
