"""A Lightning script nodectl did not write, unchanged, as a rank runs it (lib/ on its PYTHONPATH, so Python imports
nodectl's sitecustomize first): its checkpoints and validation passes reach the rank's heartbeat as the goodput
ledger's phases, its steps as reports, each figure within what the script was made to spend. (Hugging Face's
Trainer, the same way, on two isolated nodes: tests/integration/test_third_party_resume.py.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nodectl import goodput
from nodectl.resources import resource_dir
from support import REPO

pytestmark = pytest.mark.slow

SAVE, VALIDATE = 0.6, 0.4   # seconds each checkpoint and each validation pass is made to take


def test_a_lightning_scripts_checkpoints_validation_and_steps_reach_the_heartbeat(tmp_path):
    pytest.importorskip("lightning")
    run_dir = tmp_path / "run"
    for folder in ("heartbeat", "metrics", "output"):
        (run_dir / folder).mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NODECTL_")}
    env.update(NODECTL_RUN_DIR=str(run_dir), RANK="0", NODECTL_OUTPUT_DIR=str(run_dir / "output"),
               PYTHONPATH=str(resource_dir("launchers")), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(REPO / "tests" / "data" / "scripts" / "lightning_fit.py"),
                           "--save-sleep", str(SAVE), "--val-sleep", str(VALIDATE)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "finished at global step 10" in done.stdout
    assert sorted(p.name for p in (run_dir / "output").iterdir()) == ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt"]

    beat = json.loads((run_dir / "heartbeat" / "rank0.json").read_text())
    assert beat["phases_by"] == "Lightning Trainer" and beat["step"] == 10, beat
    assert 2 * SAVE <= beat["checkpoint_s"] < 2 * SAVE + 1.5, beat     # two checkpoints, steps 4 and 8
    assert 2 * VALIDATE <= beat["eval_s"] < 2 * VALIDATE + 1.5, beat   # two validation passes
    assert "data_s" not in beat   # Lightning does not say when it waits for a batch
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics" / "rank0.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 11)), steps
    assert beat["first_step"] == 1 and beat["first_step_at"] <= beat["time"]

    # the ledger takes them as they are and names what it could not see
    entries = [{"time": beat["first_step_at"] - 5, "what": "launch", "attempt": 0},
               {"time": beat["first_step_at"] - 4, "what": "started", "attempt": 0},
               {"time": beat["first_step_at"], "what": "first step", "attempt": 0}]
    spent = goodput.ledger(entries, now=beat["time"], ended=beat["time"], beats={0: beat})
    assert spent.lost["checkpoints"] == pytest.approx(beat["checkpoint_s"], abs=0.01)
    assert spent.lost["evaluation"] == pytest.approx(beat["eval_s"], abs=0.01)
    assert spent.unseen == ("data waits (Lightning Trainer does not say when they happen; nodectl_metrics.phase "
                            "marks them)",)


def test_a_script_that_reports_its_own_steps_is_not_reported_twice(tmp_path):
    """The wrapped trainer's step reports give way to the script's own nodectl_metrics.report calls."""
    pytest.importorskip("lightning")
    run_dir = tmp_path / "run"
    for folder in ("heartbeat", "metrics", "output"):
        (run_dir / folder).mkdir(parents=True)
    script = tmp_path / "own.py"
    source = (REPO / "tests" / "data" / "scripts" / "lightning_fit.py").read_text()
    script.write_text(source.replace("        return torch.nn.functional.mse_loss(self.layer(x), y)\n",
                                     "        from nodectl_metrics import report\n"
                                     "        loss = torch.nn.functional.mse_loss(self.layer(x), y)\n"
                                     "        report(step=self.global_step + 1, loss=loss.item(), own=1)\n"
                                     "        return loss\n", 1))
    env = {k: v for k, v in os.environ.items() if not k.startswith("NODECTL_")}
    env.update(NODECTL_RUN_DIR=str(run_dir), RANK="0", NODECTL_OUTPUT_DIR=str(run_dir / "output"),
               PYTHONPATH=str(resource_dir("launchers")), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics" / "rank0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 11)) and all(r.get("own") == 1 for r in records), records
    assert records[-1]["checkpoint_s"] > 0 and records[-1]["phases_by"] == "Lightning Trainer"
