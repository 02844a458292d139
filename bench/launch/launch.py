"""Launch latency against the hand-made reference, side by side in one run, on N loopback SSH nodes, 1 rank
each, a trivial torchrun script:

  * nodectl: `nodectl launch --detach --skip-preflight` until every rank's first output line exists;
  * reference: a shell loop that ssh's `nohup torchrun ... &` to each node (what users write today);
  * fail-fast: from a rank's death (its recorded exit time) to the last process of the run gone, attached.

    python bench/launch/launch.py --sizes 2 8 16 --repeats 3
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
from support.launch import run_processes  # noqa: E402
from support.sshcluster import NODE_PYTHON, SSHCluster  # noqa: E402

SCRIPT = """\
import os, time
print("first line from rank", os.environ["RANK"], flush=True)
import torch.distributed as dist
dist.init_process_group("gloo"); dist.barrier(); dist.destroy_process_group()
if os.environ.get("DIE") == os.environ["RANK"]:
    time.sleep(2); raise SystemExit(3)
time.sleep(float(os.environ.get("HOLD", "0")))
"""


WAIT = 600   # seconds either side may take to every first line (64 nodes on 2 cores: over 120)


def wait_lines(paths: list[Path], timeout: float = WAIT) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if all(p.exists() and b"first line" in p.read_bytes() for p in paths):
            return
        time.sleep(0.02)
    raise RuntimeError("ranks did not print in time")


def time_nodectl(cluster: SSHCluster, inventory: Path, project: Path, size: int) -> float:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "nodectl", "-i", str(inventory), "launch", "--skip-preflight",
                           "--detach", "--", "bench_script.py"], cwd=project, env=cluster.env(),
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    run_id = sorted(p.name for p in (project / "runs").iterdir())[-1]
    logs = [n.workdir / "runs" / run_id / "logs" / f"rank{i}.log" for i, n in enumerate(cluster.nodes[:size])]
    wait_lines(logs)
    elapsed = time.perf_counter() - started
    subprocess.run([sys.executable, "-m", "nodectl", "stop", "--run", run_id, "--grace", "1"], cwd=project,
                   env=cluster.env(), capture_output=True, timeout=120)
    return elapsed


def time_reference(cluster: SSHCluster, project: Path, size: int, port: int) -> float:
    """The script users write today: one ssh per node, nohup torchrun in the background, logs to a file. The
    script was copied to every node beforehand (not timed: the reference is spared its scp)."""
    folder = f"~/ref-{port}"
    ssh = ["ssh", "-i", str(cluster.identity), "-p", str(cluster.port), "-o", "BatchMode=yes",
           "-o", f"UserKnownHostsFile={cluster.home / '.ssh' / 'known_hosts'}"]
    started = time.perf_counter()
    procs = []
    for rank, node in enumerate(cluster.nodes[:size]):
        remote = (f"mkdir -p {folder} && nohup {NODE_PYTHON} -m torch.distributed.run --nnodes={size} "
                  f"--node-rank={rank} --nproc-per-node=1 --master-addr={cluster.nodes[0].address} "
                  f"--master-port={port} bench_script.py > {folder}/rank{rank}.log 2>&1 < /dev/null &")
        procs.append(subprocess.Popen([*ssh, f"root@{node.address}", remote], env=cluster.env()))
    for proc in procs:
        proc.wait(timeout=WAIT)
    wait_lines([node.host_path(f"{folder}/rank{r}.log") for r, node in enumerate(cluster.nodes[:size])])
    elapsed = time.perf_counter() - started
    subprocess.run(["pkill", "-f", f"master-port={port}"], capture_output=True)
    return elapsed


def time_fail_fast(cluster: SSHCluster, inventory: Path, project: Path, size: int) -> float:
    """Attached launch, rank `size-1` exits 3 after 2 s; the others would hold for 120 s."""
    proc = subprocess.run([sys.executable, "-m", "nodectl", "-i", str(inventory), "launch", "--skip-preflight",
                           "--", "bench_script.py"], cwd=project, env=cluster.env(), capture_output=True,
                          text=True, timeout=WAIT)
    gone = time.time()
    run_id = sorted(p.name for p in (project / "runs").iterdir())[-1]
    if proc.returncode != 1 or run_processes(run_id):
        raise RuntimeError(f"fail-fast did not stop the run: {proc.stderr[-1500:]}")
    node = cluster.nodes[size - 1]
    died = json.loads((node.workdir / "runs" / run_id / "ranks" / f"rank{size - 1}.exit").read_text())["time"]
    return gone - died


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 8, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-fail-fast", action="store_true", help="time the launches only")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="nodectl-launch-"))
    cluster = SSHCluster(root, count=max(args.sizes), first_octet=180).start()
    cluster.trust_host_keys()
    project = root / "project"
    project.mkdir()
    (project / "bench_script.py").write_text(SCRIPT)
    for index in range(len(cluster.nodes)):  # for the reference, which has no sync of its own
        cluster.node_file(index, "bench_script.py", SCRIPT)
    try:
        for size in args.sizes:
            inventory = cluster.inventory(root / f"hosts{size}.yaml", count=size, env={"HOLD": "120"})
            dying = cluster.inventory(root / f"dying{size}.yaml", count=size, env={"HOLD": "120", "DIE": str(size - 1)})
            ours, theirs, stops = [], [], []
            for repeat in range(args.repeats):
                ours.append(time_nodectl(cluster, inventory, project, size))
                try:
                    theirs.append(time_reference(cluster, project, size, 31000 + 100 * size + repeat))
                except (subprocess.TimeoutExpired, RuntimeError) as exc:   # 64 nodes on 2 cores, 2026-11-29
                    subprocess.run(["pkill", "-f", f"master-port={31000 + 100 * size + repeat}"], capture_output=True)
                    print(f"{size:>3} nodes, repeat {repeat + 1}: nodectl {ours[-1]:.2f}s; the ssh loop did not "
                          f"finish: {str(exc)[-160:]}", flush=True)
                    continue
                print(f"{size:>3} nodes, repeat {repeat + 1}: nodectl {ours[-1]:.2f}s  ssh loop {theirs[-1]:.2f}s",
                      flush=True)
                if args.no_fail_fast:
                    continue
                try:
                    stops.append(time_fail_fast(cluster, dying, project, size))
                except (subprocess.TimeoutExpired, RuntimeError) as exc:
                    subprocess.run(["pkill", "-f", "bench_script.py"], capture_output=True)
                    print(f"{size:>3} nodes, repeat {repeat + 1}: fail-fast did not finish: {str(exc)[-160:]}",
                          flush=True)
                    continue
                print(f"{size:>3} nodes, repeat {repeat + 1}: fail-fast {stops[-1]:.2f}s", flush=True)
            if not theirs:
                continue
            a, b = statistics.median(ours), statistics.median(theirs)
            c = f"{statistics.median(stops):.2f}s" if stops else "not measured"
            print(f"{size:>3} nodes: nodectl {a:.2f}s  reference ssh loop {b:.2f}s  ratio {a / b:.2f}x  "
                  f"rank death -> last process gone {c}", flush=True)
    finally:
        cluster.stop()
        subprocess.run(["pkill", "-f", "bench_script.py"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nmedians over {args.repeats} interleaved repeats; every rank's first output line; default grace 10 s")


if __name__ == "__main__":
    main()
