"""The attached launch's watch under load: does it ever call a healthy node lost, how fast does it name a dead
one, and what does watching cost the controller. N loopback SSH nodes (each its own sshd in its own mount
namespace), 1 CPU rank each running a gloo all-reduce loop for --seconds after importing torch, while this machine
is loaded (the ranks' and torchruns' own torch imports, plus --hogs busy processes), and with 0-10 s of latency
jitter on every --jitter-every'th node (a ProxyCommand relay that holds the node's bytes back for a random 0-10 s,
now and then).

    python bench/watch/watch.py --sizes 16 32 64 --launches 10 [--power-off 10] [--hogs 2] [--stop] [--noisy]

Per size: healthy launches and how many ended with a node called lost (the figure that must be 0); the controller's
CPU seconds and peak RSS per node per minute of watching; with --power-off, tries in which a node (not jittered)
had its sshd, sessions and ranks SIGKILLed mid-run: whether the right node was named, how fast, and whether the
run went on without it (--max-restarts 1 --exclude-failed); with --stop, `nodectl stop` of a detached run of that
size: its exit code and time, the nodes it names as not confirming, and the run's processes left. With --noisy,
every node's shell start-up files print a banner on stdout and stderr, as many clusters' do (module systems, conda):
what watching such nodes costs the controller.
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

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from support.launch import TIMED_ALL_REDUCE as SCRIPT, kill_leftovers, run_processes  # noqa: E402
from support.sshcluster import NodeSpec, SSHCluster, _sshd_sessions_under  # noqa: E402


# A ProxyCommand relay whose node-to-controller direction stalls now and then for a random 0-10 s: a congested
# path or a node too busy to send, to the controller the same.
JITTER = """\
import os, random, socket, sys, threading, time
peer = socket.create_connection((sys.argv[1], int(sys.argv[2])))
def upstream():
    while data := os.read(0, 65536):
        peer.sendall(data)
    peer.shutdown(socket.SHUT_WR)
threading.Thread(target=upstream, daemon=True).start()
stall_at = time.time() + random.uniform(5, 20)
while data := peer.recv(65536):
    if time.time() > stall_at:
        time.sleep(random.uniform(0, 10))
        stall_at = time.time() + random.uniform(5, 20)
    os.write(1, data)
"""

HOG = "while True: pass"


def jittered(cluster: SSHCluster, root: Path, every: int) -> dict[int, dict]:
    """~/.ssh/config sends every `every`'th node through the jitter relay (under an alias); inventory overrides."""
    relay = root / "jitter.py"
    relay.write_text(JITTER)
    lines, overrides = [], {}
    keys = cluster.known_hosts_lines()
    for index in range(1, len(cluster.nodes), every) if every else ():
        node, alias = cluster.nodes[index], f"jit{index}"
        lines.append(f"Host {alias}\n  HostName {node.address}\n  Port {node.port}\n  User root\n"
                     f"  IdentityFile {cluster.identity}\n"
                     f"  ProxyCommand {sys.executable} {relay} {node.address} {node.port}\n")
        overrides[index] = {"host": alias, "addr": node.address}
    (cluster.home / ".ssh" / "config").write_text("".join(lines))
    (cluster.home / ".ssh" / "known_hosts").write_text("\n".join(keys) + "\n")
    return overrides


def launch(cluster: SSHCluster, inventory: Path, project: Path, *extra: str) -> tuple[subprocess.Popen, float]:
    proc = subprocess.Popen([sys.executable, "-m", "nodectl", "-i", str(inventory), "--connect-timeout", "30",
                             "launch", "--skip-preflight", "--grace", "2", *extra, "--", "train.py"], cwd=project,
                            env=cluster.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, time.monotonic()


def runs_of(project: Path) -> set[str]:
    runs = project / "runs"
    return {p.name for p in runs.iterdir() if p.name[0].isdigit()} if runs.is_dir() else set()


def new_run(project: Path, before: set[str], proc: subprocess.Popen) -> str:
    """The run folder this launch made (not an earlier launch's)."""
    while proc.poll() is None:
        made = runs_of(project) - before
        if made:
            return made.pop()
        time.sleep(0.2)
    raise RuntimeError(f"the launch ended before it recorded a run: {proc.stderr.read()[-1500:]}")


def all_in(cluster: SSHCluster, run_id: str, size: int, timeout: float) -> float:
    """When every rank printed its first line (time.time()), within `timeout`."""
    logs = [n.workdir / "runs" / run_id / "logs" / f"rank{i}.log" for i, n in enumerate(cluster.nodes[:size])]
    deadline = time.time() + timeout
    while time.time() < deadline:
        if all(p.exists() and b"in " in p.read_bytes() for p in logs):
            return time.time()
        time.sleep(0.2)
    raise RuntimeError("the ranks did not all start in time")


def healthy(cluster, inventory, project, size) -> dict:
    before = runs_of(project)
    proc, began = launch(cluster, inventory, project)
    controller = psutil.Process(proc.pid)
    run_id = new_run(project, before, proc)
    started = all_in(cluster, run_id, size, 600)
    cpu0, peak = sum(controller.cpu_times()[:2]), 0
    while proc.poll() is None:
        try:
            peak, cpu = max(peak, controller.memory_info().rss), sum(controller.cpu_times()[:2])
        except psutil.NoSuchProcess:
            break
        time.sleep(0.5)
    watched = time.time() - started
    out, err = proc.communicate()
    kill_leftovers(run_id)
    lost = [line for line in err.splitlines() if "was lost" in line]
    return {"ok": proc.returncode == 0 and not lost, "lost": lost[:1], "code": proc.returncode,
            "cpu_s": cpu - cpu0, "watched_s": watched, "rss_mib": peak / 2**20,
            "slow_lines": sum("is slow" in line or "are slow" in line for line in err.splitlines()), "tail": err[-800:]}


def power_off(cluster, inventory, project, size, victim: int) -> dict:
    before = runs_of(project)
    proc, _ = launch(cluster, inventory, project, "--max-restarts", "1", "--exclude-failed")
    run_id = new_run(project, before, proc)
    all_in(cluster, run_id, size, 600)
    time.sleep(3)
    ranks = [p for p in run_processes(run_id) if p.environ().get("NODECTL_NODE_RANK") == str(victim)]
    sshd = cluster.nodes[victim].process
    for pid in [sshd.pid, *_sshd_sessions_under(sshd.pid)]:
        psutil.Process(pid).kill()
    for rank in ranks:
        rank.kill()
    off = time.time()
    sshd.wait(5)
    out, err = proc.communicate(timeout=900)
    kill_leftovers(run_id)
    cluster.restart_node(victim)
    manifest = json.loads((project / "runs" / run_id / "manifest.json").read_text())
    failure = (manifest.get("attempts") or [{}])[0].get("failure") or {}
    ended = (manifest.get("attempts") or [{}])[0].get("ended") or 0
    return {"named": failure.get("node"), "kind": failure.get("kind"), "right": failure.get("node") ==
            cluster.nodes[victim].name and failure.get("kind") == "lost", "after_s": ended - off,
            "restarted_without": manifest.get("state") == "succeeded" and cluster.nodes[victim].name not in
            [n["node"]["name"] for n in manifest["plan"]["nodes"]], "code": proc.returncode,
            "detail": failure.get("description", "")[:200], "tail": err[-1500:]}


def stopped(cluster, inventory, project, size) -> dict:
    """A detached launch (of `inventory`, whose ranks run for an hour), stopped with `nodectl stop` once every rank is in:
    its exit code, its time, its lines for nodes that did not confirm, and the run's processes left anywhere."""
    before = runs_of(project)
    started = subprocess.run([sys.executable, "-m", "nodectl", "-i", str(inventory), "--connect-timeout", "30",
                              "launch", "--skip-preflight", "--detach", "--", "train.py"],
                             cwd=project, env=cluster.env(), capture_output=True, text=True)
    run_id = (runs_of(project) - before).pop()
    all_in(cluster, run_id, size, 900)
    began = time.monotonic()
    stop = subprocess.run([sys.executable, "-m", "nodectl", "--connect-timeout", "30", "stop", "--run", run_id,
                           "--grace", "5"], cwd=project, env=cluster.env(), capture_output=True, text=True)
    took = time.monotonic() - began
    left = run_processes(run_id)
    kill_leftovers(run_id)
    unconfirmed = [line for line in stop.stderr.splitlines() if "did not finish" in line]
    return {"code": stop.returncode, "seconds": took, "left": len(left), "unconfirmed": unconfirmed,
            "launched": started.returncode}


def report(size: int, runs: list[dict], per_node_min: list[float]) -> None:
    false_lost = sum(1 for r in runs if r["lost"])
    print(f"== {size} nodes: {false_lost} false 'lost' in {len(runs)} launches; controller "
          f"{statistics.median(per_node_min) * 1000:.1f} CPU ms per node per minute of watching "
          f"(median), peak RSS {max(r['rss_mib'] for r in runs):.0f} MiB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--launches", type=int, default=10)
    parser.add_argument("--power-off", type=int, default=0, help="tries per size of a node powered off mid-run")
    parser.add_argument("--seconds", type=float, default=40, help="how long each rank all-reduces")
    parser.add_argument("--hogs", type=int, default=2, help="busy processes on this machine throughout")
    parser.add_argument("--stop", action="store_true", help="per size, `nodectl stop` of a detached run")
    parser.add_argument("--jitter-every", type=int, default=4, help="every N'th node behind the jitter relay; 0: none")
    parser.add_argument("--noisy", action="store_true", help="every node's login shell prints on stdout and stderr")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="nodectl-watch-"))
    specs = {i: NodeSpec(noisy=True) for i in range(max(args.sizes))} if args.noisy else {}
    cluster = SSHCluster(root, count=max(args.sizes), first_octet=100, specs=specs).start()
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(args.hogs)]
    try:
        overrides = jittered(cluster, root, args.jitter_every)
        project = root / "project"
        project.mkdir()
        (project / "train.py").write_text(SCRIPT)
        for size in args.sizes:
            inventory = cluster.inventory(root / f"hosts{size}.yaml", count=size, node_overrides=overrides,
                                          env={"SECONDS_TO_RUN": str(args.seconds)})
            runs = []
            for number in range(args.launches):
                runs.append(healthy(cluster, inventory, project, size))
                r = runs[-1]
                print(f"{size} nodes, launch {number + 1}: {'ok' if r['ok'] else 'FAILED'} (exit {r['code']}), "
                      f"{r['slow_lines']} slow notice(s), controller {r['cpu_s']:.1f} CPU s over "
                      f"{r['watched_s']:.0f} s watched, peak RSS {r['rss_mib']:.0f} MiB {r['lost'] or ''}",
                      flush=True)
                if not r["ok"]:
                    print(r["tail"], flush=True)
            per_node_min = [r["cpu_s"] / size / (r["watched_s"] / 60) for r in runs if r["watched_s"] > 0]
            if runs:
                report(size, runs, per_node_min)
            tries = []
            for number in range(args.power_off):
                victim = next(i for i in range(size - 1, 0, -1) if i not in overrides)
                tries.append(power_off(cluster, inventory, project, size, victim))
                t = tries[-1]
                print(f"{size} nodes, power-off {number + 1}: named {t['named']} ({t['kind']}) "
                      f"{'right' if t['right'] else 'WRONG'} after {t['after_s']:.1f} s; restarted without it: "
                      f"{t['restarted_without']}; {t['detail']}", flush=True)
                if not t["right"] or not t["restarted_without"]:
                    print(t["tail"], flush=True)
            if args.stop:
                hold = cluster.inventory(root / f"hold{size}.yaml", count=size, node_overrides=overrides,
                                         env={"SECONDS_TO_RUN": "3600"})
                st = stopped(cluster, hold, project, size)
                print(f"== {size} nodes: nodectl stop exited {st['code']} in {st['seconds']:.1f} s, {st['left']} "
                      f"process(es) of the run left; not confirmed: {st['unconfirmed'] or 'none'}", flush=True)
            if tries:
                print(f"== {size} nodes: right node named in {sum(t['right'] for t in tries)} of {len(tries)}, "
                      f"within {max(t['after_s'] for t in tries):.1f} s (worst), restarted without it in "
                      f"{sum(t['restarted_without'] for t in tries)}", flush=True)
    finally:
        for hog in hogs:
            hog.kill()
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
