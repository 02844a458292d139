"""A rank killed with SIGKILL together with its wrapper (the OOM killer takes the biggest, a `kill -9` of the
process group takes all) leaves no exit code; its node still answers. `status` says
it was killed, not that it was lost (which is what a node that restarted under its run is)."""
from __future__ import annotations

import json
import os
import signal
import sys

import psutil
import pytest

from conftest import run_nodectl
from launch_helpers import kill_leftovers, latest_run_id, wait_for

pytestmark = pytest.mark.slow

SCRIPT = "import os, time\nprint('rank', os.environ['RANK'], 'pid', os.getpid(), flush=True)\ntime.sleep(60)\n"


def test_a_rank_killed_with_sigkill_is_killed_not_lost(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(f"nodes:\n  - {{host: localhost, name: n0, transport: local, device: cpu, gpus: 2, "
                     f"python: {sys.executable}, workdir: {tmp_path / 'work'}}}\n")
    env = dict(os.environ, NODECTL_INVENTORY=str(hosts), COLUMNS="200")
    started = run_nodectl(["launch", "--skip-preflight", "--detach", "--", "train.py"], env=env, cwd=tmp_path)
    assert started.exit_code == 0, started.output
    run_id = latest_run_id(tmp_path)
    try:
        ranks = wait_for(lambda: [r for r in run_nodectl(["--json", "status"], env=env, cwd=tmp_path).json()["ranks"]
                                  if r.get("pid")] or None, timeout=60)
        victim = next(r for r in ranks if r["rank"] == 1)
        wrapper = psutil.Process(victim["pid"]).parent()   # rankexec, which records a rank's exit: killed first
        assert "rankexec" in " ".join(wrapper.cmdline())
        os.kill(wrapper.pid, signal.SIGKILL)
        os.kill(victim["pid"], signal.SIGKILL)
        status = wait_for(lambda: (lambda s: s if any(r["rank"] == 1 and r["state"] == "killed" for r in s["ranks"])
                                   else None)(run_nodectl(["--json", "status"], env=env, cwd=tmp_path).json()),
                          timeout=60)
        assert not any(r["state"] == "lost" for r in status["ranks"]), json.dumps(status["ranks"])
        shown = run_nodectl(["status"], env=env, cwd=tmp_path)
        assert "killed" in shown.stdout and "SIGKILL or the kernel's OOM killer" in shown.stdout, shown.stdout
    finally:
        run_nodectl(["stop", "--run", run_id], env=env, cwd=tmp_path)
        kill_leftovers(run_id)
