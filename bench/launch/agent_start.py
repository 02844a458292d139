"""torchrun's agent as launch.sh starts it (launchers/elastic_agent.py: torch imported with Python's collector off,
then frozen out of its later passes) against `python -m torch.distributed.run`, the same arguments, side by side:
the agent's own CPU (not its ranks') over a run of two gloo ranks that all-reduce for --seconds. A B B A, --rounds
times.

    .venv/bin/python bench/launch/agent_start.py --rounds 3 [--seconds 8]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
AGENT = REPO / "launchers" / "elastic_agent.py"
RANK = """\
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t, end = torch.ones(1), time.time() + float(__import__("os").environ["SECONDS_TO_RUN"])
while time.time() < end:
    dist.all_reduce(t)
    time.sleep(0.1)
dist.destroy_process_group()
"""
# the agent's own CPU at its exit, printed by the process itself (its ranks' CPU is its children's, not counted)
MEASURED = """\
import atexit, resource, runpy, sys
def said():
    use = resource.getrusage(resource.RUSAGE_SELF)
    print("AGENT_CPU", use.ru_utime + use.ru_stime, file=sys.stderr, flush=True)
atexit.register(said)
how, sys.argv = sys.argv[1], [sys.argv[2]] + sys.argv[3:]
if how == "module":
    runpy.run_module("torch.distributed.run", run_name="__main__")
else:
    sys.path[0] = sys.argv[0].rsplit("/", 1)[0]   # as `python lib/elastic_agent.py` has it
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


def one(how: str, folder: Path, seconds: float) -> float:
    first = ["module", "torchrun"] if how == "python -m torch.distributed.run" else ["path", str(AGENT)]
    env = {**os.environ, "SECONDS_TO_RUN": str(seconds), "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    done = subprocess.run([sys.executable, "-c", MEASURED, *first, "--standalone", "--nproc-per-node", "2",
                           "--monitor-interval", "0.5", "rank.py"], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=seconds + 120)
    if done.returncode != 0:
        raise SystemExit(f"{how} failed: {done.stderr[-2000:]}")
    return float(next(line for line in done.stderr.splitlines() if line.startswith("AGENT_CPU")).split()[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    hows = ("python -m torch.distributed.run", "lib/elastic_agent.py")
    cpu = {how: [] for how in hows}
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "rank.py").write_text(RANK)
        one(hows[0], Path(folder), 1.0)   # a warm-up: bytecode written, files in the page cache
        for _ in range(args.rounds):
            for how in (*hows, *reversed(hows)):   # A B B A
                cpu[how].append(one(how, Path(folder), args.seconds))
    for how in hows:
        values = cpu[how]
        print(f"{how:34s} agent CPU median {statistics.median(values):.2f} s (range {min(values):.2f}-"
              f"{max(values):.2f}, {len(values)} runs)")
    ratio = statistics.median(cpu[hows[1]]) / statistics.median(cpu[hows[0]])
    print(f"elastic_agent.py / python -m: {ratio:.2f}x")


if __name__ == "__main__":
    main()
