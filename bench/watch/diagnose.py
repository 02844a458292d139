"""How fast `nodectl diagnose` answers, and what it costs a healthy run, in one command (CPU is fine):

    .venv/bin/python bench/watch/diagnose.py [--nodes 2 --ranks 4]

1. A hung run (tests/data/diagnose/scenarios/behind.py: rank 3 skips an all_reduce and sleeps) on NODES local
   nodes x RANKS gloo ranks: the wall time of `nodectl diagnose`, from the command to its verdict.
2. A healthy run (every rank: all_reduce of 1 MiB in a loop, its rate printed each second): the rate in the seconds
   while `nodectl diagnose` runs against the seconds before, which is what a user asking "is it hung?" costs it.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STEADY = """\
import time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
tensor, count, mark = torch.ones(1 << 18), 0, time.time()
print("hung from here", flush=True)
while True:
    dist.all_reduce(tensor)
    count += 1
    if time.time() - mark >= 1.0:
        print(f"rate {count / (time.time() - mark):.1f} at {time.time():.3f}", flush=True)
        count, mark = 0, time.time()
"""


def nodectl(project: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nodectl", "-i", "hosts.yaml", *args], cwd=project,
                          capture_output=True, text=True, timeout=600)


def started(project: Path, script: str, nodes: int, ranks: int) -> None:
    node_lines = "".join(f"  - {{name: node{i}, host: 127.0.0.1}}\n" for i in range(nodes))
    (project / "hosts.yaml").write_text(f"defaults: {{transport: local, device: cpu, gpus: {ranks}}}\nnodes:\n"
                                        + node_lines)
    result = nodectl(project, "launch", "--skip-preflight", "--detach", "--", script)
    if result.returncode:
        raise SystemExit(result.stderr)
    deadline = time.monotonic() + 300
    while nodectl(project, "tail", "all", "-n", "50").stdout.count("hung from here") < nodes * ranks:
        if time.monotonic() > deadline:
            raise SystemExit("the ranks never started")
        time.sleep(1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        project = Path(folder)
        shutil.copy(REPO / "tests" / "data" / "diagnose" / "scenarios" / "behind.py", project)
        (project / "steady.py").write_text(STEADY)
        started(project, "behind.py", args.nodes, args.ranks)
        time.sleep(7)
        began = time.monotonic()
        result = nodectl(project, "--json", "diagnose")
        seconds = time.monotonic() - began
        verdict = json.loads(result.stdout)
        nodectl(project, "stop", "--grace", "1")
        print(f"hung run, {args.nodes} nodes x {args.ranks} ranks: diagnose printed its verdict in {seconds:.1f} s "
              f"(exit {result.returncode}): {verdict['summary']}")

        started(project, "steady.py", args.nodes, args.ranks)
        time.sleep(5)
        windows = []
        for _ in range(3):
            quiet_from = time.time()
            time.sleep(6)
            busy_from = time.time()
            nodectl(project, "diagnose")
            windows.append((quiet_from, busy_from, time.time()))
        log = nodectl(project, "tail", "rank0", "-n", "200").stdout
        nodectl(project, "stop", "--grace", "1")
    rates = [(float(m.group(2)), float(m.group(1))) for m in re.finditer(r"rate ([\d.]+) at ([\d.]+)", log)]
    quiet = [r for t, r in rates for a, b, _ in windows if a + 1 <= t <= b]
    busy = [r for t, r in rates for _, b, c in windows if b < t <= c + 1]
    if quiet and busy:
        print(f"healthy run, all_reduce of 1 MiB per second on rank 0: {statistics.median(quiet):.0f} before, "
              f"{statistics.median(busy):.0f} while diagnose ran ({len(quiet)} and {len(busy)} one-second samples; "
              f"ratio {statistics.median(busy) / statistics.median(quiet):.2f})")


if __name__ == "__main__":
    main()
