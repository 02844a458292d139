"""torchrun's agent as launch.sh starts it (launchers/elastic_agent.py): torchrun itself, with torch imported while
Python's collector is off and frozen out of its later passes, and `python -m`'s path (the run's code folder first,
not lib/)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

AGENT = Path(__file__).resolve().parents[2] / "launchers" / "elastic_agent.py"

RANK = """\
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([dist.get_rank() + 1.0]); dist.all_reduce(total)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} sum {total.item():g} args {sys.argv[1:]}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_the_agent_runs_torchruns_ranks_with_their_arguments(tmp_path):
    (tmp_path / "rank.py").write_text(RANK)
    done = subprocess.run([sys.executable, str(AGENT), "--standalone", "--nproc-per-node", "2", "--monitor-interval",
                           "0.5", "rank.py", "--flag", "a b"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    said = sorted(re.findall(r"rank \d of \d sum \d args \[[^]]*\]", done.stdout))   # the ranks share a stdout
    assert said == ["rank 0 of 2 sum 3 args ['--flag', 'a b']", "rank 1 of 2 sum 3 args ['--flag', 'a b']"], done.stdout


def test_torch_is_imported_with_the_collector_off_then_frozen_and_the_path_is_as_with_dash_m(tmp_path):
    copy = tmp_path / "lib" / "elastic_agent.py"
    copy.parent.mkdir()
    copy.write_text(AGENT.read_text())
    (copy.parent / "torch.py").write_text("raise SystemExit('a torch.py in lib/ must never shadow torch')")
    work = tmp_path / "code"
    work.mkdir()
    probe = ("import gc, runpy, sys; sys.argv = [sys.argv[1]]; sys.path[0] = sys.argv[0].rsplit('/', 1)[0]; "
             "runpy.run_path(sys.argv[0], run_name='elastic_agent'); "
             "print(gc.isenabled(), gc.get_freeze_count(), sys.path[0], 'torch.distributed.run' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe, str(copy)], cwd=work, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    enabled, frozen, first, imported = done.stdout.split()
    assert enabled == "True" and int(frozen) > 50_000   # torch's module graph, out of the collector's walks
    assert first == str(work) and imported == "True"
