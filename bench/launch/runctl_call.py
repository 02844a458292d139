"""What one call of runctl costs on a node, side by side for two trees of nodectl, A B B A (CPU).

    .venv/bin/python bench/launch/runctl_call.py --tree before=/tmp/wt-before --tree after=. [--calls 30] [--rounds 2]

Each tree's runctl artifact is installed in a private folder of its own, as nodectl installs it on a node, and
called as nodectl calls it there (`python -S -c VERIFIED <artifact> <sha256> port 0`: the artifact's check, then
the command), its request on stdin, without SSH. Per tree: the CPU seconds (user + system) and wall milliseconds of
one call, medians over every call of every round; the first call of each tree (which may compile and keep the
code) is shown apart. Rounds alternate the trees A B B A.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHOW = ("import json, sys; from nodectl.remote import agent; data, short, full = agent._runctl(); "
        "sys.stdout.buffer.write(json.dumps({'verified': agent.VERIFIED, 'short': short, 'full': full, "
        "'size': len(data)}).encode() + b'\\n' + data)")


def artifact_of(tree: Path) -> tuple[str, str, bytes]:
    out = subprocess.run([sys.executable, "-c", SHOW], capture_output=True, check=True, cwd=tree,   # not ours
                         env={**os.environ, "PYTHONPATH": str(tree)}).stdout
    head, data = out.split(b"\n", 1)
    said = json.loads(head)
    assert len(data) == said["size"]
    return said["verified"], said["full"], data


def one_call(verified: str, artifact: Path, full: str) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    proc = subprocess.run([sys.executable, "-S", "-c", verified, str(artifact), full, "port", "0"], input=b"{}",
                          capture_output=True)
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if b'"port"' not in proc.stdout:
        raise SystemExit(f"{artifact}: runctl answered {proc.stdout[-300:]!r} {proc.stderr[-300:]!r}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tree", action="append", required=True, metavar="NAME=PATH")
    parser.add_argument("--calls", type=int, default=30, help="calls per tree per round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per tree")
    args = parser.parse_args()
    trees = [(name, Path(path).resolve()) for name, path in (t.split("=", 1) for t in args.tree)]
    if len(trees) != 2:
        raise SystemExit("give two trees: --tree A=PATH --tree B=PATH")
    installed = {}
    for name, tree in trees:
        folder = Path(tempfile.mkdtemp(prefix=f"runctl-{name}-"))   # 0700, this user's: as VERIFIED wants it
        verified, full, data = artifact_of(tree)
        artifact = folder / "runctl.pyz"
        artifact.write_bytes(data)
        artifact.chmod(0o600)
        installed[name] = verified, artifact, full
        cpu, wall = one_call(verified, artifact, full)
        print(f"{name}: first call {cpu:.3f} CPU s, {wall * 1000:.0f} ms", flush=True)
    calls: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in trees}
    order = [trees[0], trees[1], trees[1], trees[0]] * ((args.rounds + 1) // 2)
    for name, _ in order[:2 * args.rounds]:
        calls[name] += [one_call(*installed[name]) for _ in range(args.calls)]
    print(f"\none runctl call (`port 0`), median of {args.calls * args.rounds} per tree, A B B A:")
    medians = {}
    for name, _ in trees:
        cpus, walls = zip(*calls[name])
        medians[name] = statistics.median(cpus), statistics.median(walls)
        print(f"  {name}: {medians[name][0]:.3f} CPU s (range {min(cpus):.3f}-{max(cpus):.3f}), "
              f"{medians[name][1] * 1000:.0f} ms")
    (a, _), (b, _) = trees
    print(f"  {b}/{a}: CPU {medians[b][0] / medians[a][0]:.3f}x, wall {medians[b][1] / medians[a][1]:.3f}x")


if __name__ == "__main__":
    main()
