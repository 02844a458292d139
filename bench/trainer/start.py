"""What a built-in trainer rank costs to start, side by side for two trees of the trainer, A B B A (CPU).

    .venv/bin/python bench/trainer/start.py --tree before=/tmp/wt-before --tree after=. [--rounds 3] [--ranks 2]

Each run is `torchrun --nproc-per-node RANKS -m trainer` of the built-in demo recipe for 2 steps (gloo, this
machine), the tree first on PYTHONPATH. Per tree: the wall seconds of the whole run, the CPU seconds of torchrun and
its ranks together (their rusage), and the seconds from the start to rank 0's first step line; medians over the
rounds. The demo model is made once, before the first round, in a cache of the bench's own.
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def one(tree: Path, ranks: int, work: Path, port: int) -> tuple[float, float, float]:
    out = Path(tempfile.mkdtemp(dir=work))
    env = {**os.environ, "PYTHONPATH": str(tree), "NODECTL_DEMO_CACHE": str(work / "demo"), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)   # as on a node: the tree's bytecode written once, then read
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
                             f"--master-port={port}", "-m", "trainer", "--set", f"train.output_dir={out}",
                             "--set", "train.steps=2", "--set", "train.log_every=1"], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first, said = None, []
    for line in proc.stdout:
        said.append(line)
        if first is None and re.match(r"\s*step\s+1\s", line):
            first = time.perf_counter() - began
    if proc.wait() != 0 or first is None:
        raise SystemExit(f"{tree}: the run failed (exit {proc.returncode}):\n{''.join(said[-20:])}")
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, first


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tree", action="append", required=True, metavar="NAME=PATH")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    trees = [(name, Path(path).resolve()) for name, path in (t.split("=", 1) for t in args.tree)]
    if len(trees) != 2:
        raise SystemExit("give two trees: --tree A=PATH --tree B=PATH")
    work = Path(tempfile.mkdtemp(prefix="nodectl-start-"))
    subprocess.run([sys.executable, "-c", "from trainer import demo; demo.ensure_demo()"], check=True,
                   env={**os.environ, "PYTHONPATH": str(trees[1][1]), "NODECTL_DEMO_CACHE": str(work / "demo")})
    figures: dict[str, list[tuple[float, float, float]]] = {name: [] for name, _ in trees}
    order = [trees[0], trees[1], trees[1], trees[0]] * ((args.rounds + 1) // 2)
    for index, (name, tree) in enumerate(order[:2 * args.rounds]):
        figures[name].append(one(tree, args.ranks, work, 29700 + index))
        wall, cpu, first = figures[name][-1]
        print(f"{name}: wall {wall:.2f} s, CPU {cpu:.2f} s, first step at {first:.2f} s", flush=True)
    print(f"\n{args.ranks} rank(s), the demo for 2 steps, medians of {args.rounds} run(s) each, A B B A:")
    medians = {}
    for name, _ in trees:
        walls, cpus, firsts = zip(*figures[name])
        medians[name] = statistics.median(walls), statistics.median(cpus), statistics.median(firsts)
        print(f"  {name}: wall {medians[name][0]:.2f} s, CPU {medians[name][1]:.2f} s "
              f"(range {min(cpus):.2f}-{max(cpus):.2f}), first step at {medians[name][2]:.2f} s")
    (a, _), (b, _) = trees
    print(f"  {b}/{a}: wall {medians[b][0] / medians[a][0]:.3f}x, CPU {medians[b][1] / medians[a][1]:.3f}x, "
          f"first step {medians[b][2] / medians[a][2]:.3f}x")


if __name__ == "__main__":
    main()
