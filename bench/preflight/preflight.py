"""Wall time of `nodectl preflight --quick` and of the default tier (probe, gloo all-reduce test, the history read
and written) on N isolated loopback SSH nodes, and what the preflight history adds: the default tier with a full
history (KEPT entries of this cluster's figures) against an empty one, alternated, in the same run.
Targets: quick under 5 s at 16 nodes; the history adding under 5% (medians).

    python bench/preflight/preflight.py --nodes 16 --repeats 3
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from support.sshcluster import SSHCluster  # noqa: E402

from nodectl.preflight.history import KEPT, History  # noqa: E402


def timed(cluster: SSHCluster, args: list[str], cwd: Path, state: Path, tree: str | None = None) -> tuple[float, dict]:
    """Seconds of one nodectl command (this checkout's, or with `tree` another checkout's on PYTHONPATH)."""
    started = time.perf_counter()
    extra = {"PYTHONPATH": tree} if tree else {}
    proc = subprocess.run([sys.executable, "-m", "nodectl", "--json", *args], env=cluster.env(
        NODECTL_STATE_DIR=str(state), **extra), cwd=cwd, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-1500:] + proc.stderr[-1500:])
    return seconds, json.loads(proc.stdout)


def fill_history(state: Path, document: dict) -> None:
    """KEPT entries like the one this preflight wrote (the history read is then its largest)."""
    history = History(state)
    line = history.path.read_text().splitlines()[-1]
    history.path.write_text((line + "\n") * KEPT)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compare", metavar="CHECKOUT",
                        help="another checkout of nodectl (git worktree add /tmp/old REV): its quick tier alternated "
                             "with this one's, and only the quick tier is timed")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="nodectl-preflight-"))
    cluster = SSHCluster(root, count=args.nodes, first_octet=210).start()
    cluster.trust_host_keys()
    inventory = cluster.inventory(gpus=1)
    empty, full = root / "state-empty", root / "state-full"
    if args.compare:
        try:
            this, other = [], []
            for _ in range(args.repeats):   # alternated: the machine's drift falls on both alike
                this.append(timed(cluster, ["-i", str(inventory), "preflight", "--quick"], root, empty)[0])
                other.append(timed(cluster, ["-i", str(inventory), "preflight", "--quick"], root, empty,
                                   tree=args.compare)[0])
                print(f"quick: this tree {this[-1]:.2f} s, {args.compare} {other[-1]:.2f} s", flush=True)
        finally:
            cluster.stop()
            shutil.rmtree(root, ignore_errors=True)
        a, b = statistics.median(this), statistics.median(other)
        print(f"{args.nodes} nodes x 1 gloo rank, quick tier: this tree {a:.2f} s, {args.compare} {b:.2f} s "
              f"({a / b:.3f}x; target < 5 s); medians of {args.repeats}")
        return
    try:
        _, first = timed(cluster, ["-i", str(inventory), "preflight"], root, full)
        fill_history(full, first)
        quick = [timed(cluster, ["-i", str(inventory), "preflight", "--quick"], root, empty)[0]
                 for _ in range(args.repeats)]
        print(f"quick: {', '.join(f'{q:.2f}' for q in quick)} s", flush=True)
        without, with_history = [], []
        for _ in range(args.repeats):   # alternated: the machine's drift falls on both alike
            shutil.rmtree(empty, ignore_errors=True)
            without.append(timed(cluster, ["-i", str(inventory), "preflight"], root, empty)[0])
            fill_history(full, first)
            with_history.append(timed(cluster, ["-i", str(inventory), "preflight"], root, full)[0])
            print(f"default tier: {without[-1]:.2f} s without history, {with_history[-1]:.2f} s with", flush=True)
        history = History(full)
        started = time.perf_counter()
        entries = history.entries()
        read = time.perf_counter() - started
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    q, a, b = (statistics.median(x) for x in (quick, without, with_history))
    print(f"{args.nodes} nodes x 1 gloo rank: quick {q:.2f} s (target < 5 s); default tier {a:.2f} s without history, "
          f"{b:.2f} s with {len(entries)} entries ({b / a:.3f}x; target < 1.05x); the history read alone "
          f"{read * 1000:.1f} ms; medians of {args.repeats}")


if __name__ == "__main__":
    main()
