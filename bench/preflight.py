"""Wall time of `nodectl preflight --quick` and of the full tier (gloo collective test) on 2 loopback SSH nodes.
Targets: quick under 5 s, with the collective under 30 s (medians).

    python bench/preflight.py --repeats 3
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.sshcluster import SSHCluster  # noqa: E402


def timed(cluster: SSHCluster, args: list[str], cwd: Path) -> float:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "nodectl", *args], env=cluster.env(), cwd=cwd,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-1500:] + proc.stderr[-1500:])
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="nodectl-preflight-"))
    cluster = SSHCluster(root, count=2, first_octet=210).start()
    cluster.trust_host_keys()
    inventory = cluster.inventory(gpus=2)
    try:
        quick = [timed(cluster, ["-i", str(inventory), "preflight", "--quick"], root) for _ in range(args.repeats)]
        full = [timed(cluster, ["-i", str(inventory), "preflight"], root) for _ in range(args.repeats)]
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    print(f"2 nodes x 2 gloo ranks: quick {statistics.median(quick):.2f}s (target < 5 s), "
          f"with collective test {statistics.median(full):.2f}s (target < 30 s); medians of {args.repeats}")


if __name__ == "__main__":
    main()
