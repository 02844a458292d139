"""The straggler verdict (issue 51) on CPU, 2 isolated SSH nodes x 2 gloo ranks, in one command:

    .venv/bin/python bench/watch/straggler.py [--repeats 3] [--healthy 600] [--scripts ddp,trainer] [--cause hog]

For each script (bench/watch/scripts/ddp_plain.py, a plain DDP loop written for no tool; and the built-in trainer):
1. time to name: an attached `nodectl launch`; once its pace is judged, rank 3 (node1) is held to 20% of a CPU
   (a cgroup quota; with --cause hog, pinned to one core where another process spins); the seconds until the launch
   prints "straggler: rank 3 on node node1", and the cause it names. Median of --repeats.
2. a healthy run of --healthy seconds: any straggler line is a false verdict.
3. the cost of the measurement: the DDP loop's steps/s (from rank 0's own wall-clock lines) with the pace off
   (NODECTL_PACE_EVERY=0) and on, alternated, each --cost seconds.
Needs root (the nodes' namespaces, the cgroup). Prints each figure and the ratios.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from support.launch import kill_leftovers  # noqa: E402
from support.slowdown import cpu_hog, cpu_quota, rank_process  # noqa: E402
from support.sshcluster import SSHCluster  # noqa: E402

DDP = (REPO / "bench" / "watch" / "scripts" / "ddp_plain.py").read_text()
RECIPE = "train: {steps: 100000, log_every: 5, save_every: 0}\n"
ENV: dict = {}   # the cluster's: its known hosts and keys


class Launch:
    """An attached launch whose stderr lines are kept with the time each came."""

    def __init__(self, project: Path, inventory: Path, args: list[str]) -> None:
        self.lines: list[tuple[float, str]] = []
        self.before = {p.name for p in (project / "runs").glob("2*")} if (project / "runs").exists() else set()
        self.proc = subprocess.Popen([sys.executable, "-m", "nodectl", "-i", str(inventory), "launch",
                                      "--skip-preflight", "--gpus", "2", *args], cwd=project, env=ENV,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        threading.Thread(target=lambda: self.lines.extend((time.monotonic(), line) for line in self.proc.stderr),
                         daemon=True).start()
        self.out: list[str] = []
        threading.Thread(target=lambda: self.out.extend(self.proc.stdout), daemon=True).start()
        self.project = project

    def run_id(self) -> str:
        for _ in range(600):
            if self.proc.poll() is not None:
                break
            runs = [p for p in (self.project / "runs").glob("2*") if (p / "manifest.json").exists()
                    and p.name not in self.before]
            if runs:
                return max(runs).name
            time.sleep(0.2)
        self.proc.kill()
        raise SystemExit("no run started: " + "".join(line for _, line in self.lines)[-2000:])

    def paced(self, run_id: str, timeout: float = 240) -> None:
        manifest = self.project / "runs" / run_id / "manifest.json"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (json.loads(manifest.read_text()).get("pace") or {}).get("pace") is not None:
                return
            time.sleep(1)
        raise SystemExit(f"no pace judged in {timeout:.0f}s: {''.join(line for _, line in self.lines)[-2000:]}\n"
                         f"record: {json.dumps(json.loads(manifest.read_text()).get('pace'))[:1500]}\n"
                         f"rank 0: {''.join(self.out)[-500:]}")

    def stop(self, run_id: str) -> None:
        subprocess.run([sys.executable, "-m", "nodectl", "stop", "--grace", "1", "--run", run_id], cwd=self.project,
                       capture_output=True, timeout=120, env=ENV)
        self.proc.kill()
        kill_leftovers(run_id)


def time_to_name(project: Path, inventory: Path, args: list[str], script: str, cause: str = "quota") -> float | None:
    launch = Launch(project, inventory, args)
    run_id = launch.run_id()
    try:
        launch.paced(run_id)
        slow = rank_process(run_id, 3, script)
        with (cpu_quota(slow.pid, 0.2) if cause == "quota" else cpu_hog(slow.pid)) as held_by:
            held = time.monotonic()
            while time.monotonic() - held < 120:
                said = [(at, line) for at, line in launch.lines if "straggler: rank 3 on node node1" in line]
                if said:
                    spinner = f" (the spinning process: pid {held_by.pid})" if cause == "hog" else ""
                    print(f"  {said[0][1].strip()}{spinner}", flush=True)
                    return said[0][0] - held
                time.sleep(0.5)
        shown = subprocess.run([sys.executable, "-m", "nodectl", "status", "--run", run_id], cwd=project, env=ENV,
                               capture_output=True, text=True, timeout=120).stdout
        print(f"  not named in 120 s; the launch said: {''.join(line for _, line in launch.lines)[-800:]}\n"
              f"  status: {shown[-1500:]}", flush=True)
        return None
    finally:
        launch.stop(run_id)


def healthy(project: Path, inventory: Path, args: list[str], seconds: float) -> list[str]:
    launch = Launch(project, inventory, args)
    run_id = launch.run_id()
    try:
        time.sleep(seconds)
        return [line.strip() for _, line in launch.lines if "straggler" in line or "every rank is slower" in line]
    finally:
        launch.stop(run_id)


def ddp_rate(project: Path, inventory: Path, seconds: float) -> float:
    """Steps/s of the DDP loop from rank 0's own lines (wall clock), after its first 20 s."""
    launch = Launch(project, inventory, ["--", "ddp_plain.py", "10000000", "640"])
    run_id = launch.run_id()
    try:
        time.sleep(seconds + 20)
    finally:
        launch.stop(run_id)
    marks = [(int(m[1]), float(m[2])) for m in re.finditer(r"step (\d+) loss \S+ time ([\d.]+)", "".join(launch.out))]
    start = next(i for i, (_, t) in enumerate(marks) if t >= marks[0][1] + 20)
    (s0, t0), (s1, t1) = marks[start], marks[-1]
    return (s1 - s0) / (t1 - t0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--healthy", type=float, default=600)
    parser.add_argument("--cost", type=float, default=60)
    parser.add_argument("--scripts", default="ddp,trainer")
    parser.add_argument("--cause", choices=("quota", "hog"), default="quota",
                        help="what holds rank 3 back: a CPU quota of 20%%, or another process spinning on its core")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="nodectl-straggler-"))
    cluster = SSHCluster(root, count=2, first_octet=230).start()   # no test uses 127.x.0.230
    cluster.trust_host_keys()
    ENV.update(cluster.env())
    project = root / "project"
    project.mkdir()
    (project / "ddp_plain.py").write_text(DDP)
    (project / "recipe.yaml").write_text(RECIPE)
    cache = root / "demo-cache"
    inventory = cluster.inventory(root / "hosts.yaml", count=2, env={"NODECTL_DEMO_CACHE": str(cache)})
    quiet = cluster.inventory(root / "quiet.yaml", count=2, env={"NODECTL_PACE_EVERY": "0"})
    scripts = {"ddp": (["--", "ddp_plain.py", "10000000", "640"], "ddp_plain.py"),
               "trainer": (["--config", "recipe.yaml"], "nodectl_trainer")}
    try:
        for name in args.scripts.split(","):
            launch_args, marker = scripts[name]
            times = [time_to_name(project, inventory, launch_args, marker, args.cause) for _ in range(args.repeats)]
            named = [t for t in times if t is not None]
            if args.repeats:   # --repeats 0: the healthy run alone
                print(f"{name}: named in {', '.join('never' if t is None else f'{t:.1f}s' for t in times)}; "
                      f"median {statistics.median(named):.1f}s" if named else f"{name}: never named", flush=True)
            if args.healthy:
                false = healthy(project, inventory, launch_args, args.healthy)
                print(f"{name}: healthy {args.healthy:.0f}s run: {len(false)} verdict(s) {false[:2]}", flush=True)
        if args.cost:
            pairs = [(ddp_rate(project, quiet, args.cost), ddp_rate(project, inventory, args.cost)) for _ in range(2)]
            for off, on in pairs:
                print(f"ddp cost: pace off {off:.2f} steps/s, on {on:.2f} steps/s: on/off {on / off:.3f}", flush=True)
            off, on = (statistics.mean(p[i] for p in pairs) for i in (0, 1))
            print(f"ddp cost, mean of {len(pairs)} pairs: on/off {on / off:.3f}", flush=True)
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
