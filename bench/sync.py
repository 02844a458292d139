"""Sending a project to N nodes: nodectl against pdcp and a parallel scp, side by side in one run, on N loopback
SSH nodes that share nothing with this machine (tests/sshcluster.py), with the controller's peak memory.

    python bench/sync.py --nodes 32 --mb 200 --repeats 2

  * nodectl: `nodectl launch --skip-preflight --detach` of a script that exits at once: the whole sync (content
    hashes, the store check, the streamed tar, the run folder on every node) plus the detached start. Each
    repeat starts from empty node stores, so every byte is sent again.
  * pdcp -r (pdsh's copy, fan-out N) and `scp -r` to every node at once: copy only, each with OpenSSH's
    default cipher and with AES-GCM.
Peak RSS: the nodectl process (or pdcp, or the sum of the scp processes), sampled every 50 ms. Machine CPU: the
user + system seconds of the whole machine during each transfer (every side of it runs here); sender CPU: that
of the sending side alone (nodectl, or pdcp/scp with their ssh clients).
Needs openssh-server and pdsh (apt-get install pdsh); runs as root.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from sshcluster import SSHCluster  # noqa: E402


# OpenSSH's default cipher (chacha20-poly1305) and AES-GCM, which is faster on CPUs with AES-NI: each reference
# at its best. nodectl asks for AES-GCM first, in paramiko and in the system ssh alike.
CIPHERS = (("chacha20-poly1305@openssh.com", ""), ("aes128-gcm@openssh.com", " aes-gcm"))


def ssh_options(cluster: SSHCluster, cipher: str) -> list[str]:
    return ["-i", str(cluster.identity), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-c", cipher,
            "-o", f"UserKnownHostsFile={cluster.home / '.ssh' / 'known_hosts'}"]


class PeakRSS:
    """The largest resident set of a process and its children, sampled while it runs."""

    def __init__(self, pids) -> None:
        self.pids, self.peak, self._stop = pids, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            total = 0
            for pid in self.pids():
                try:
                    process = psutil.Process(pid)
                    total += sum(p.memory_info().rss for p in [process, *process.children(recursive=True)])
                except psutil.Error:
                    continue
            self.peak = max(self.peak, total)
            self._stop.wait(0.05)

    def __enter__(self) -> "PeakRSS":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def client_cpu() -> float:
    """CPU seconds (user + system) of this process's waited-for children: the sending side alone (nodectl, or
    pdcp or scp with their ssh clients)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def machine_cpu() -> float:
    """CPU seconds (user + system) the whole machine spent so far: controller, sshds and node-side processes
    all share it here, so this is what one transfer costs in all."""
    times = psutil.cpu_times()
    return times.user + times.system


def fresh_nodes(cluster: SSHCluster, count: int) -> None:
    for node in cluster.nodes[:count]:
        for folder in (node.workdir, node.home_dir / "pdcp", node.home_dir / "scp"):
            shutil.rmtree(folder, ignore_errors=True)
        (node.home_dir / "pdcp").mkdir()


def time_nodectl(cluster: SSHCluster, inventory: Path, project: Path, count: int, size: int) -> tuple[float, int]:
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "nodectl", "-i", str(inventory), "launch", "--skip-preflight",
                             "--detach", "--sync-limit", "100000", "--", "quick.py"], cwd=project, env=cluster.env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with PeakRSS(lambda: [proc.pid]) as rss:
        out, err = proc.communicate(timeout=1200)
    elapsed = time.perf_counter() - started
    runs = project / "runs"
    if proc.returncode or not runs.is_dir():
        raise RuntimeError(f"nodectl failed (exit {proc.returncode}): {err[-1500:]}")
    run_id = sorted(p.name for p in runs.iterdir() if p.name[0].isdigit())[-1]
    end_run(run_id)
    arrived = [n.workdir / "runs" / run_id / "code" / "code" / "payload.bin" for n in cluster.nodes[:count]]
    if proc.returncode or not all(p.is_file() and p.stat().st_size == size for p in arrived):
        raise RuntimeError(f"nodectl did not deliver everywhere: {err[-1500:]}")
    return elapsed, rss.peak


def end_run(run_id: str) -> None:
    """The detached run's torchruns (a 32-node rendezvous of a script that exits at once) must not linger into
    the next measurement: every process whose environment carries the run id is killed."""
    for process in psutil.process_iter():
        try:
            if process.environ().get("NODECTL_RUN_ID") == run_id:
                process.kill()
        except psutil.Error:
            continue


def time_pdcp(cluster: SSHCluster, project: Path, count: int, size: int, cipher: str) -> tuple[float, int]:
    hosts = ",".join(n.address for n in cluster.nodes[:count])
    env = {**cluster.env(), "PDSH_SSH_ARGS": " ".join(ssh_options(cluster, cipher) + ["-p", str(cluster.port)]) + " %h",
           "PDSH_RCMD_TYPE": "ssh"}
    started = time.perf_counter()
    proc = subprocess.Popen(["pdcp", "-R", "ssh", "-f", str(count), "-w", hosts, "-r", str(project / "code"),
                             "/root/pdcp/"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with PeakRSS(lambda: [proc.pid]) as rss:
        out, err = proc.communicate(timeout=1200)
    elapsed = time.perf_counter() - started
    arrived = [n.home_dir / "pdcp" / "code" / "payload.bin" for n in cluster.nodes[:count]]
    if proc.returncode or not all(p.is_file() and p.stat().st_size == size for p in arrived):
        raise RuntimeError(f"pdcp did not deliver everywhere: {err[-1500:]}")
    return elapsed, rss.peak


def time_scp(cluster: SSHCluster, project: Path, count: int, size: int, cipher: str) -> tuple[float, int]:
    started = time.perf_counter()
    procs = [subprocess.Popen(["scp", "-q", "-r", *ssh_options(cluster, cipher), "-P", str(cluster.port),
                               str(project / "code"), f"root@{node.address}:/root/scp"], env=cluster.env(),
                              stderr=subprocess.PIPE) for node in cluster.nodes[:count]]
    with PeakRSS(lambda: [p.pid for p in procs if p.poll() is None]) as rss:
        codes = [p.wait(timeout=1200) for p in procs]
    elapsed = time.perf_counter() - started
    arrived = [n.home_dir / "scp" / "payload.bin" for n in cluster.nodes[:count]]
    if any(codes) or not all(p.is_file() and p.stat().st_size == size for p in arrived):
        raise RuntimeError(f"scp did not deliver everywhere: {[p.stderr.read()[-300:] for p in procs if p.returncode]}")
    return elapsed, rss.peak


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if not shutil.which("pdcp"):
        sys.exit("pdcp is not installed (apt-get install pdsh)")
    root = Path(tempfile.mkdtemp(prefix="nodectl-sync-"))
    project = root / "project"
    (project / "code").mkdir(parents=True)
    size = args.mb << 20
    with open(project / "code" / "payload.bin", "wb") as handle:  # incompressible, like weights or data
        block = os.urandom(1 << 20)
        for i in range(args.mb):
            handle.write(bytes([i % 256]) + block[1:])
    (project / "quick.py").write_text("print('started')\n")
    cluster = SSHCluster(root / "cluster", count=args.nodes, first_octet=120).start()
    cluster.trust_host_keys()
    inventory = cluster.inventory(root / "hosts.yaml")
    runs = {"nodectl": lambda: time_nodectl(cluster, inventory, project, args.nodes, size)}
    for cipher, label in CIPHERS:
        runs[f"pdcp{label}"] = lambda c=cipher: time_pdcp(cluster, project, args.nodes, size, c)
        runs[f"scp{label}"] = lambda c=cipher: time_scp(cluster, project, args.nodes, size, c)
    results: dict[str, list] = {name: [] for name in runs}
    cpu: dict[str, list] = {name: [] for name in results}
    client: dict[str, list] = {name: [] for name in results}
    try:
        for _ in range(args.repeats):  # interleaved, so drift on a noisy machine hits all three alike
            for name, run in runs.items():
                fresh_nodes(cluster, args.nodes)
                before, before_client = machine_cpu(), client_cpu()
                results[name].append(run())
                cpu[name].append(machine_cpu() - before)
                client[name].append(client_cpu() - before_client)
                print(f"   {name}: {results[name][-1][0]:.1f}s, peak RSS {results[name][-1][1] >> 20} MiB, "
                      f"machine CPU {cpu[name][-1]:.1f}s, sender CPU {client[name][-1]:.1f}s", flush=True)
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    medians = {name: statistics.median(t for t, _ in runs) for name, runs in results.items()}
    best = min(t for name, t in medians.items() if name != "nodectl")
    print(f"\n{args.mb} MiB to {args.nodes} nodes, median of {args.repeats} (machine: {os.cpu_count()} cores):")
    for name, runs in results.items():
        print(f"   {name:16} {medians[name]:6.1f}s  {medians[name] / best:5.2f}x the faster reference  "
              f"peak RSS {max(r for _, r in runs) >> 20} MiB  machine CPU {statistics.median(cpu[name]):.1f}s  "
              f"sender CPU {statistics.median(client[name]):.1f}s")


if __name__ == "__main__":
    main()
