"""The README's main job on this machine: `nodectl launch --nodes 2 --gpus 1 --skip-preflight` (the built-in
trainer's demo on two local "nodes"), timed from the command's start to its exit, with the machine's CPU seconds
spent meanwhile; against the plain tool at its best (one torchrun of 2 ranks, which sets OMP_NUM_THREADS=1 itself)
and, with --compare, another checkout's nodectl, alternated A B B A.

    python bench/trainer/local_demo.py --repeats 2 --compare /tmp/old     # git worktree add /tmp/old REV
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def cpu_seconds() -> float:
    with open("/proc/stat", encoding="ascii") as handle:
        fields = handle.readline().split()[1:]
    return (int(fields[0]) + int(fields[1]) + int(fields[2]) + int(fields[5]) + int(fields[6])) / os.sysconf(
        "SC_CLK_TCK")


def timed(argv: list[str], env: dict, cwd: Path) -> tuple[float, float]:
    began, cpu = time.perf_counter(), cpu_seconds()
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=900)
    wall, used = time.perf_counter() - began, cpu_seconds() - cpu
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-2000:])
    return wall, used


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--compare", metavar="CHECKOUT", help="another checkout of nodectl, alternated with this one")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="nodectl-demo-"))
    cache = work / "cache"
    base = {k: v for k, v in os.environ.items() if not k.startswith("NODECTL_") and k != "OMP_NUM_THREADS"}
    base.update(NODECTL_DEMO_CACHE=str(cache), NODECTL_FORCE_CPU="1", HOME=str(work / "home"))

    def nodectl(tree: Path) -> tuple[float, float]:
        project = work / f"project-{tree.name}-{time.monotonic_ns()}"
        project.mkdir(parents=True)
        return timed([sys.executable, "-m", "nodectl", "launch", "--nodes", "2", "--gpus", "1", "--skip-preflight"],
                     {**base, "PYTHONPATH": str(tree)}, project)

    def torchrun() -> tuple[float, float]:
        out = work / f"torchrun-{time.monotonic_ns()}"
        return timed([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
                      "--master-port=29731", "-m", "trainer", "--set", f"train.output_dir={out}"],
                     {**base, "PYTHONPATH": str(REPO)}, work)

    try:
        torchrun()   # the demo's model and data, built once
        order = [REPO, Path(args.compare).resolve()] if args.compare else [REPO]
        sequence = []
        for repeat in range(args.repeats):
            sequence += order if repeat % 2 == 0 else order[::-1]   # A B B A
        figures: dict[str, list[tuple[float, float]]] = {}
        for tree in sequence:
            figures.setdefault(str(tree), []).append(nodectl(tree))
        figures["torchrun"] = [torchrun() for _ in range(args.repeats)]
        print(f"{'what':<48} {'wall s (median)':>16} {'CPU s (median)':>15}   each")
        for name, runs in figures.items():
            label = "torchrun, 2 ranks (OMP_NUM_THREADS=1)" if name == "torchrun" else \
                f"nodectl launch --nodes 2 ({'this tree' if name == str(REPO) else name})"
            print(f"{label:<48} {statistics.median(w for w, _ in runs):>16.2f} "
                  f"{statistics.median(c for _, c in runs):>15.1f}   "
                  + ", ".join(f"{w:.1f}/{c:.0f}" for w, c in runs))
        this = statistics.median(w for w, _ in figures[str(REPO)])
        for name, runs in figures.items():
            if name != str(REPO):
                print(f"this tree / {name if name != 'torchrun' else 'torchrun'}: "
                      f"{this / statistics.median(w for w, _ in runs):.2f}x wall")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
