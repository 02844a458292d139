"""env-dump over N loopback SSH nodes, against pdsh (-R ssh) and a sequential ssh loop running the same probe
on the same nodes, side by side in one run. Prints medians and ratios.

    python bench/launch/fanout.py --sizes 8 32 64 --repeats 3
Needs openssh-server and pdsh (apt-get install openssh-server pdsh); runs as root (sshd on 127.0.0.x).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from support.sshcluster import NODE_PYTHON, SSHCluster  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PROBE = REPO / "launchers" / "probe.py"


def ssh_options(cluster: SSHCluster) -> list[str]:
    return ["-i", str(cluster.identity), "-p", str(cluster.port), "-o", "BatchMode=yes",
            "-o", f"UserKnownHostsFile={cluster.home / '.ssh' / 'known_hosts'}", "-o", "StrictHostKeyChecking=yes"]


def probe_command(node) -> str:
    return f"{NODE_PYTHON} - {node.workdir_setting}"


def time_nodectl(cluster: SSHCluster, inventory: Path, count: int) -> float:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "nodectl", "-i", str(inventory), "--json", "env-dump"],
                          env=cluster.env(), capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0 or proc.stdout.count('"probe_version"') != count:
        raise RuntimeError(f"nodectl env-dump failed: {proc.stderr[-2000:]}")
    return elapsed


def time_pdsh(cluster: SSHCluster, count: int) -> float:
    hosts = ",".join(n.address for n in cluster.nodes[:count])
    # pdsh's ssh module takes ssh options through PDSH_SSH_ARGS. pdsh forwards no stdin, so it runs a copy of the
    # probe placed on every node beforehand (not timed); nodectl ships it over stdin each time.
    env = {**cluster.env(), "PDSH_SSH_ARGS": " ".join(ssh_options(cluster)) + " %h",
           "PDSH_RCMD_TYPE": "ssh"}
    started = time.perf_counter()
    proc = subprocess.run(["pdsh", "-R", "ssh", "-f", "64", "-w", hosts, f"{NODE_PYTHON} ~/probe.py /tmp"],
                          stdin=subprocess.DEVNULL, env=env, capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - started
    if proc.stdout.count('"probe_version"') != count:
        raise RuntimeError(f"pdsh got {proc.stdout.count('probe_version')} reports: {proc.stderr[-1500:]}")
    return elapsed


def time_sequential(cluster: SSHCluster, count: int) -> float:
    source = PROBE.read_bytes()
    started = time.perf_counter()
    for node in cluster.nodes[:count]:
        proc = subprocess.run(["ssh", *ssh_options(cluster), f"root@{node.address}", probe_command(node)],
                              input=source, capture_output=True, env=cluster.env(), timeout=120)
        if b'"probe_version"' not in proc.stdout:
            raise RuntimeError(f"ssh to {node.address} failed: {proc.stderr[-500:]!r}")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sequential-max", type=int, default=32, help="largest size the sequential loop runs")
    args = parser.parse_args()
    if not shutil.which("pdsh"):
        sys.exit("pdsh is not installed (apt-get install pdsh)")
    root = Path(tempfile.mkdtemp(prefix="nodectl-fanout-"))
    cluster = SSHCluster(root, count=max(args.sizes), first_octet=100).start()
    cluster.trust_host_keys()
    for index in range(len(cluster.nodes)):  # the nodes see none of this machine's files
        cluster.node_file(index, "probe.py", PROBE.read_text())
    rows = []
    try:
        for size in args.sizes:
            inventory = cluster.inventory(root / f"hosts{size}.yaml", count=size)
            results = {"nodectl": [], "pdsh": [], "sequential": []}
            for _ in range(args.repeats):  # interleaved, so drift on a noisy machine hits all three alike
                results["nodectl"].append(time_nodectl(cluster, inventory, size))
                results["pdsh"].append(time_pdsh(cluster, size))
                if size <= args.sequential_max:
                    results["sequential"].append(time_sequential(cluster, size))
            medians = {k: statistics.median(v) if v else None for k, v in results.items()}
            rows.append((size, medians))
            seq = medians["sequential"]
            print(f"{size:>3} nodes: nodectl {medians['nodectl']:.2f}s  pdsh {medians['pdsh']:.2f}s  "
                  f"ratio nodectl/pdsh {medians['nodectl'] / medians['pdsh']:.2f}x  "
                  + (f"sequential {seq:.2f}s  speed-up vs sequential {seq / medians['nodectl']:.1f}x" if seq else
                     "sequential: not run"), flush=True)
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    print("\nmedian seconds over", args.repeats, "interleaved repeats; machine:", os.cpu_count(), "cores")


if __name__ == "__main__":
    main()
