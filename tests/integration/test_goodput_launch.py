"""The goodput ledger on a real launch (issue 67's CPU bench, in the suite): a plain script with delays injected
where the ledger must find them (start-up, checkpoints, data), killed once and restarted. Every second of the run
lands in one kind, the kinds add up to the wall clock within 2%, and each injected delay is found in its own kind
within 10%; `status`, `runs` and their --json say it."""
from __future__ import annotations

import pytest

from support.cli import run_nodectl
from support.launch import kill_leftovers, latest_run_id

pytestmark = pytest.mark.slow

START, DATA, CKPT, WORK, STEPS, KILL_AT = 3.0, 0.05, 0.6, 0.1, 50, 35
SCRIPT = f"""\
import os, time
from nodectl_metrics import phase, report

time.sleep({START})   # start-up: what a model load or a compile costs
mark = os.path.join(os.environ["NODECTL_OUTPUT_DIR"], "step")
start = int(open(mark).read()) if os.path.exists(mark) else 0
for step in range(start + 1, {STEPS} + 1):
    began = time.time(); time.sleep({DATA}); phase("data", time.time() - began)
    time.sleep({WORK})
    report(step=step, loss=1.0 / step)
    if step % 10 == 0:
        began = time.time(); time.sleep({CKPT})
        open(mark, "w").write(str(step))
        phase("checkpoint", time.time() - began)
    if os.environ["NODECTL_ATTEMPT"] == "0" and step == {KILL_AT}:
        os._exit(3)
"""


def test_a_restarted_runs_seconds_add_up_and_each_injected_delay_is_found_in_its_kind(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "ledger.py").write_text(SCRIPT)
    env = {"HOME": str(tmp_path / "home"), "NODECTL_FORCE_CPU": "1"}
    done = run_nodectl(["launch", "--nodes", "1", "--gpus", "1", "--skip-preflight", "--max-restarts", "1", "--",
                        "ledger.py"], env=env, cwd=project, timeout=300)
    run_id = latest_run_id(project)
    kill_leftovers(run_id)
    assert done.exit_code == 0, done.output[-3000:]
    status = run_nodectl(["--json", "status"], env=env, cwd=project).json()
    spent = status["goodput"]
    lost = spent["lost_s"]
    assert spent["productive_s"] + sum(lost.values()) == pytest.approx(spent["wall_s"], rel=0.02)
    # the script ran steps 1-35, then 31-50: 55 data waits, 3 + 2 checkpoints
    assert lost["data waits"] == pytest.approx(55 * DATA, rel=0.1), spent
    assert lost["checkpoints"] == pytest.approx(5 * CKPT, rel=0.1), spent
    assert lost["start-up"] >= START and lost["restarts"] >= START, spent   # each attempt's sleep before its steps
    # steps 31-35 again: their training time (their data waits are in their own kind)
    assert lost["work redone"] == pytest.approx(5 * WORK, rel=0.35), spent
    assert lost["failures"] < 10 and lost["set-up"] < 30, spent
    assert [a["continued_from"] for a in spent["attempts"]] == [None, 30], spent["attempts"]
    # what is left is the training itself: 50 steps of 0.1 s at least (a loaded machine adds to each step)
    assert STEPS * WORK * 0.9 <= spent["productive_s"] <= STEPS * WORK * 2 and spent["goodput"] < 0.9, spent
    shown = run_nodectl(["status"], env=env, cwd=project).stdout
    assert f"goodput {spent['goodput'] * 100:.0f}%; lost " in shown and "restarts" in shown, shown
    # the restarted run tells its story: how attempt 0 ended, where attempt 1 went on from, what it did again
    assert status["attempts"][0].startswith("attempt 0: failed (rank 0 on node local0 failed (exit code 3))"), status
    assert status["attempts"][1].startswith("attempt 1: succeeded; went on from step 30, ") and \
        status["attempts"][1].endswith(" of work done again"), status["attempts"]
    listed = run_nodectl(["--json", "runs"], env=env, cwd=project).json()["runs"]
    assert listed[-1]["goodput"]["goodput"] == spent["goodput"]
    table = run_nodectl(["runs"], env={**env, "COLUMNS": "200"}, cwd=project).stdout
    assert f"{spent['goodput'] * 100:.0f}%" in table and f"{run_id} lost " in table, table
    # report draws it: the attempts, the failure, the restart, the work redone (after collect, like every report);
    # a plain script's end is the run's, not "unknown"
    assert run_nodectl(["collect", "--run", run_id], env=env, cwd=project).exit_code == 0
    drawn = run_nodectl(["--json", "report", "--run", run_id], env=env, cwd=project)
    assert drawn.exit_code == 0, drawn.output[-2000:]
    assert any(p.endswith("timeline.png") for p in drawn.json()["plots"]), drawn.json()
    assert drawn.json()["summary"]["goodput"]["goodput"] == spent["goodput"]
    assert drawn.json()["summary"]["end_reason"] == "succeeded", drawn.json()["summary"]
    said = run_nodectl(["report", "--run", run_id], env=env, cwd=project).stdout
    assert f"goodput {spent['goodput'] * 100:.0f}%; lost " in said and "attempt 1: succeeded; went on from step 30" \
        in said, said
