"""Sending a project to N nodes: nodectl against pdcp and a parallel scp, side by side in one run, on N loopback
SSH nodes that share nothing with this machine (tests/support/sshcluster.py), with the controller's peak memory.

    python bench/launch/sync.py --nodes 32 --mb 200 --repeats 2

  * nodectl: `nodectl launch --skip-preflight --detach` of a script that exits at once, timed twice from the same
    run: until it prints "code ready on N node(s)" (the content hashes, the store check, the streamed tar and
    the run folder on every node: what pdcp and scp do), and until it returns (the detached start of torchrun
    on every node too). Each repeat starts from empty node stores, so every byte is sent again.
  * pdcp -r (pdsh's copy, fan-out N) and `scp -r` to every node at once: copy only, each with OpenSSH's
    default cipher and with AES-GCM.
Memory: the sending side (nodectl, or pdcp, or the scp processes, each with its ssh children), sampled while it
runs: the peak of the summed RSS (which counts the shared libraries of every ssh child again), of the summed
PSS (each shared page split between the processes that map it: the memory they take together), and the RSS of
the sending process alone (nodectl or pdcp without its ssh children; one scp). CPU:
the user + system seconds of the whole machine during each transfer (every side of it runs here), of the
sending side alone, and of the nodes' sshds and everything they ran (the receiving side).
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
from dataclasses import dataclass
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from support.sshcluster import SSHCluster  # noqa: E402


# OpenSSH's default cipher (chacha20-poly1305) and AES-GCM, which is faster on CPUs with AES-NI: each reference
# at its best. nodectl asks for AES-GCM first, in paramiko and in the system ssh alike.
CIPHERS = (("chacha20-poly1305@openssh.com", ""), ("aes128-gcm@openssh.com", " aes-gcm"))


def ssh_options(cluster: SSHCluster, cipher: str) -> list[str]:
    return ["-i", str(cluster.identity), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-c", cipher,
            "-o", f"UserKnownHostsFile={cluster.home / '.ssh' / 'known_hosts'}"]


class PeakMemory:
    """The largest summed RSS and PSS of a process and its children, sampled while it runs (PSS, from smaps,
    every 4th sample: it costs more to read)."""

    def __init__(self, pids) -> None:
        self.pids, self.peak, self.peak_pss, self._stop = pids, 0, 0, threading.Event()
        self.peak_alone = 0  # the first process by itself (nodectl, pdcp; the scps are all alike)
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        tick = 0
        while not self._stop.is_set():
            rss = pss = 0
            for i, pid in enumerate(self.pids()):
                try:
                    process = psutil.Process(pid)
                    if i == 0:
                        self.peak_alone = max(self.peak_alone, process.memory_info().rss)
                    for p in [process, *process.children(recursive=True)]:
                        rss += p.memory_info().rss
                        pss += p.memory_full_info().pss if tick % 4 == 0 else 0
                except psutil.Error:
                    continue
            self.peak = max(self.peak, rss)
            self.peak_pss = max(self.peak_pss, pss)
            tick += 1
            self._stop.wait(0.05)

    def __enter__(self) -> "PeakMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Sample:
    seconds: float
    rss: int
    pss: int
    alone: int  # RSS of the sending process itself, without its ssh children
    ready: float | None = None  # nodectl: when it said the code is on every node


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


def node_cpu(cluster: SSHCluster, count: int) -> float:
    """CPU seconds of the nodes' sshds and of every process they ran and reaped (sessions, shells, tar, scp,
    runctl): the receiving side."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for node in cluster.nodes[:count]:
        with open(f"/proc/{node.process.pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        total += sum(int(x) for x in fields[11:15]) / ticks  # utime, stime, cutime, cstime
    return total


def fresh_nodes(cluster: SSHCluster, count: int) -> None:
    for node in cluster.nodes[:count]:
        for folder in (node.workdir, node.home_dir / "pdcp", node.home_dir / "scp"):
            shutil.rmtree(folder, ignore_errors=True)
        (node.home_dir / "pdcp").mkdir()


READY = "code ready on"


def time_nodectl(cluster: SSHCluster, inventory: Path, project: Path, count: int, size: int) -> Sample:
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "nodectl", "-i", str(inventory), "launch", "--skip-preflight",
                             "--detach", "--sync-limit", "100000", "--", "quick.py"], cwd=project, env=cluster.env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = {"ready": None, "err": []}

    def read_stderr() -> None:  # the moment the line arrives is when the user sees it
        for line in proc.stderr:
            if READY in line and seen["ready"] is None:
                seen["ready"] = time.perf_counter() - started
            seen["err"].append(line)

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    with PeakMemory(lambda: [proc.pid]) as memory:
        proc.stdout.read()
        proc.wait(timeout=1200)
    elapsed = time.perf_counter() - started
    reader.join()
    err = "".join(seen["err"])
    runs = project / "runs"
    if proc.returncode or not runs.is_dir() or seen["ready"] is None:
        raise RuntimeError(f"nodectl failed (exit {proc.returncode}): {err[-1500:]}")
    run_id = sorted(p.name for p in runs.iterdir() if p.name[0].isdigit())[-1]
    end_run(run_id)
    arrived = [n.workdir / "runs" / run_id / "code" / "code" / "payload.bin" for n in cluster.nodes[:count]]
    if not all(p.is_file() and p.stat().st_size == size for p in arrived):
        raise RuntimeError(f"nodectl did not deliver everywhere: {err[-1500:]}")
    return Sample(elapsed, memory.peak, memory.peak_pss, memory.peak_alone, seen["ready"])


def end_run(run_id: str) -> None:
    """The detached run's torchruns (a 32-node rendezvous of a script that exits at once) must not linger into
    the next measurement: every process whose environment carries the run id is killed."""
    for process in psutil.process_iter():
        try:
            if process.environ().get("NODECTL_RUN_ID") == run_id:
                process.kill()
        except psutil.Error:
            continue


def time_pdcp(cluster: SSHCluster, project: Path, count: int, size: int, cipher: str) -> Sample:
    hosts = ",".join(n.address for n in cluster.nodes[:count])
    env = {**cluster.env(), "PDSH_SSH_ARGS": " ".join(ssh_options(cluster, cipher) + ["-p", str(cluster.port)]) + " %h",
           "PDSH_RCMD_TYPE": "ssh"}
    started = time.perf_counter()
    proc = subprocess.Popen(["pdcp", "-R", "ssh", "-f", str(count), "-w", hosts, "-r", str(project / "code"),
                             "/root/pdcp/"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with PeakMemory(lambda: [proc.pid]) as memory:
        out, err = proc.communicate(timeout=1200)
    elapsed = time.perf_counter() - started
    arrived = [n.home_dir / "pdcp" / "code" / "payload.bin" for n in cluster.nodes[:count]]
    if proc.returncode or not all(p.is_file() and p.stat().st_size == size for p in arrived):
        raise RuntimeError(f"pdcp did not deliver everywhere: {err[-1500:]}")
    return Sample(elapsed, memory.peak, memory.peak_pss, memory.peak_alone)


def time_scp(cluster: SSHCluster, project: Path, count: int, size: int, cipher: str) -> Sample:
    started = time.perf_counter()
    procs = [subprocess.Popen(["scp", "-q", "-r", *ssh_options(cluster, cipher), "-P", str(cluster.port),
                               str(project / "code"), f"root@{node.address}:/root/scp"], env=cluster.env(),
                              stderr=subprocess.PIPE) for node in cluster.nodes[:count]]
    with PeakMemory(lambda: [p.pid for p in procs if p.poll() is None]) as memory:
        codes = [p.wait(timeout=1200) for p in procs]
    elapsed = time.perf_counter() - started
    arrived = [n.home_dir / "scp" / "payload.bin" for n in cluster.nodes[:count]]
    if any(codes) or not all(p.is_file() and p.stat().st_size == size for p in arrived):
        raise RuntimeError(f"scp did not deliver everywhere: {[p.stderr.read()[-300:] for p in procs if p.returncode]}")
    return Sample(elapsed, memory.peak, memory.peak_pss, memory.peak_alone)


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
    results: dict[str, list[Sample]] = {name: [] for name in runs}
    cpu = {name: {"machine": [], "sender": [], "nodes": []} for name in runs}
    try:
        for _ in range(args.repeats):  # interleaved, so drift on a noisy machine hits all of them alike
            for name, run in runs.items():
                fresh_nodes(cluster, args.nodes)
                before = machine_cpu(), client_cpu(), node_cpu(cluster, args.nodes)
                sample = run()
                after = machine_cpu(), client_cpu(), node_cpu(cluster, args.nodes)
                for key, b, a in zip(("machine", "sender", "nodes"), before, after):
                    cpu[name][key].append(a - b)
                results[name].append(sample)
                ready = f" (code ready at {sample.ready:.1f}s)" if sample.ready is not None else ""
                usage = cpu[name]
                print(f"   {name}: {sample.seconds:.1f}s{ready}, peak RSS {sample.rss >> 20} MiB (alone "
                      f"{sample.alone >> 20}), PSS {sample.pss >> 20} MiB, CPU machine {usage['machine'][-1]:.1f}s "
                      f"sender {usage['sender'][-1]:.1f}s nodes {usage['nodes'][-1]:.1f}s", flush=True)
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    median = statistics.median
    rows = {name: median(s.seconds for s in samples) for name, samples in results.items()}
    rows["nodectl, code ready"] = median(s.ready for s in results["nodectl"])
    best_name = min((n for n in rows if not n.startswith("nodectl")), key=rows.get)
    best = rows[best_name]
    print(f"\n{args.mb} MiB to {args.nodes} nodes, median of {args.repeats} (machine: {os.cpu_count()} cores); "
          f"fastest reference: {best_name}")
    for name in ["nodectl, code ready", *results]:
        samples = results["nodectl" if name.startswith("nodectl") else name]
        usage = cpu["nodectl" if name.startswith("nodectl") else name]
        label = "nodectl, launch" if name == "nodectl" else name
        rss, alone, pss = (max(getattr(s, key) for s in samples) >> 20 for key in ("rss", "alone", "pss"))
        print(f"   {label:20} {rows[name]:6.1f}s  {rows[name] / best:5.2f}x  peak RSS {rss} MiB (alone {alone})  "
              f"PSS {pss} MiB  CPU machine {median(usage['machine']):.1f}s  sender {median(usage['sender']):.1f}s  "
              f"nodes {median(usage['nodes']):.1f}s")
    print(f"RESULT nodes={args.nodes} mb={args.mb} ready_ratio={rows['nodectl, code ready'] / best:.2f} "
          f"launch_ratio={rows['nodectl'] / best:.2f} nodectl_pss_mib={max(s.pss for s in results['nodectl']) >> 20} "
          f"nodectl_rss_alone_mib={max(s.alone for s in results['nodectl']) >> 20}")


if __name__ == "__main__":
    main()
