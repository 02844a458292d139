"""How soon `nodectl launch` tells a crashed rank, side by side for two trees of nodectl, A B B A.

    .venv/bin/python bench/watch/notice.py --tree before=/tmp/wt-before --tree after=. [--rounds 3] [--ranks 2]

Each launch is `nodectl launch --nodes 1 --gpus RANKS --skip-preflight` on this machine (local transport) of a
plain gloo script that SIGKILLs its rank 0 two seconds after the process group is up, having written the time
first. Per tree: the seconds from that kill to the launch's line naming it (`... failed (killed by SIGKILL)`), and
to the launch's exit (the run stopped on every node), medians over the rounds. A tree is a checkout of nodectl,
put first on PYTHONPATH (its runctl and templates come with it). Rounds alternate the trees A B B A.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = '''import os, signal, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
time.sleep(2.0)
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)
'''


def one(tree: Path, ranks: int, work: Path) -> tuple[float, float]:
    project = Path(tempfile.mkdtemp(dir=work))
    (project / "crash.py").write_text(SCRIPT)
    kill_at = project / "kill_at"
    env = {**os.environ, "PYTHONPATH": str(tree), "NODECTL_RUNS": str(work / "runs"), "PYTHONUNBUFFERED": "1"}
    env.pop("NODECTL_INVENTORY", None)
    proc = subprocess.Popen([sys.executable, "-m", "nodectl", "launch", "--nodes", "1", "--gpus", str(ranks),
                             "--skip-preflight", "crash.py", str(kill_at)], cwd=project, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    told = None
    for line in proc.stdout:
        if told is None and "killed by SIGKILL" in line:
            told = time.time()
    proc.wait()
    ended = time.time()
    killed = float(kill_at.read_text())
    if told is None:
        raise SystemExit(f"{tree}: the launch never named the kill (exit {proc.returncode})")
    return told - killed, ended - killed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tree", action="append", required=True, metavar="NAME=PATH")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    trees = [(name, Path(path).resolve()) for name, path in (t.split("=", 1) for t in args.tree)]
    work = Path(tempfile.mkdtemp(prefix="notice-"))
    found: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in trees}
    order = trees + trees[::-1]
    for _ in range(args.rounds):
        for name, tree in order:
            told, ended = one(tree, args.ranks, work)
            found[name].append((told, ended))
            print(f"{name}: told {told:.2f} s after the kill, launch ended {ended:.2f} s after it", flush=True)
    print("\ntree | runs | kill to the line naming it (median, range) | kill to the launch's exit (median)")
    for name, _ in trees:
        told = [t for t, _ in found[name]]
        ended = [e for _, e in found[name]]
        print(f"{name} | {len(told)} | {statistics.median(told):.2f} s ({min(told):.2f}-{max(told):.2f}) | "
              f"{statistics.median(ended):.2f} s")


if __name__ == "__main__":
    main()
