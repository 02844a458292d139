"""Time to a ready locked environment on N isolated nodes, nodectl against plain loops, side by side in one run.

The nodes are sshd's in network namespaces whose firewall lets nothing out but the cluster's subnet (no package
index). The requirements are torch 2.13.0 (CPU) and six. Every contestant installs the same wheels:

  * nodectl: `nodectl launch --environment requirements.txt` of a one-line script; the figure is the wall time of
    the whole command (environment, then the run), and nodectl's own "environment ... in X s" is shown beside it;
  * reference, sequential: `for node: scp requirements.txt; ssh node 'python -m venv ref && ref/bin/pip install
    -r requirements.txt'`, pip reaching the same wheels through an HTTP find-links server on the controller
    (--no-index --find-links, --no-compile: its fastest settings);
  * reference, parallel: the same loop with every node's ssh in the background (`&`, then wait).

A nodectl launch includes the run of the one-line script (torchrun and `import torch` on every node); the launch
that reuses the venvs shows that share, and nodectl's own timer of the environment step is printed beside each.
Then one package changes (six 1.16.0 -> 1.17.0): nodectl builds a new venv per node (torch's wheel is not sent
again, uv links its files from its cache on the node); the references run the same `pip install -r` into the venv
they have (pip upgrades six in place). Last, the nodes are wiped and nodectl builds from nothing again with the
controller's wheels cached, as the references' server has them.

    python bench/launch/environments.py --nodes 8
"""
from __future__ import annotations

import argparse
import functools
import http.server
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from support.sshcluster import NODE_PYTHON, namespaced_cluster  # noqa: E402

SUBNET = "10.79"
PORT = 18099
SCRIPT = "import six, torch; print('ready', six.__version__, torch.__version__, flush=True)\n"


def nodectl_launch(cluster, project: Path, count: int) -> tuple[float, str]:
    inventory = cluster.inventory(count=count, gpus=1)
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "nodectl", "-i", str(inventory), "launch", "--skip-preflight",
                           "--environment", "requirements.txt", "--", "train.py"], cwd=project, env=cluster.env(),
                          capture_output=True, text=True, timeout=3600)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    line = next(line for line in proc.stderr.splitlines() if line.startswith("environment venv"))
    return elapsed, line


def ssh_argv(cluster, node, command: str) -> list[str]:
    return ["ssh", "-i", str(cluster.identity), "-p", str(node.port), "-o", "BatchMode=yes",
            "-o", f"UserKnownHostsFile={cluster.home / '.ssh' / 'known_hosts'}", f"root@{node.address}", command]


def reference_one(cluster, node, k: int, requirements: Path) -> None:
    scp = ["scp", "-q", "-i", str(cluster.identity), "-P", str(node.port), "-o", "BatchMode=yes",
           "-o", f"UserKnownHostsFile={cluster.home / '.ssh' / 'known_hosts'}", str(requirements),
           f"root@{node.address}:requirements.txt"]
    subprocess.run(scp, check=True, capture_output=True, timeout=600)
    command = (f"[ -x ref/bin/python ] || {NODE_PYTHON} -m venv ref && ref/bin/pip install -q --no-compile "
               f"--disable-pip-version-check --no-index --trusted-host {SUBNET}.{k}.1 "
               f"--find-links http://{SUBNET}.{k}.1:{PORT}/ "
               f"-r requirements.txt")
    proc = subprocess.run(ssh_argv(cluster, node, command), capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{node.name}: {proc.stderr[-2000:]}")


def reference(cluster, count: int, requirements: Path, parallel: bool) -> float:
    started = time.perf_counter()
    if parallel:
        with ThreadPoolExecutor(count) as pool:
            list(pool.map(lambda k: reference_one(cluster, cluster.nodes[k], k, requirements), range(count)))
    else:
        for k in range(count):
            reference_one(cluster, cluster.nodes[k], k, requirements)
    return time.perf_counter() - started


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def serve(folder: Path) -> http.server.ThreadingHTTPServer:
    handler = functools.partial(QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("0.0.0.0", PORT), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def wipe(cluster, count: int, what: str) -> None:
    for node in cluster.nodes[:count]:
        subprocess.run(ssh_argv(cluster, node, f"rm -rf {what}"), capture_output=True, timeout=600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=8)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="nodectl-bench-env-"))
    project = root / "project"
    project.mkdir()
    (project / "train.py").write_text(SCRIPT)
    requirements = project / "requirements.txt"
    rows = []
    try:
        with namespaced_cluster(root / "cluster", args.nodes, SUBNET, "bn", offline=True) as cluster:
            requirements.write_text("six==1.16.0\ntorch==2.13.0\n")
            fresh, line = nodectl_launch(cluster, project, args.nodes)
            rows.append(("nodectl, from nothing", fresh, line))
            print(f"nodectl, from nothing: {fresh:.1f} s; {line}", flush=True)
            again, line = nodectl_launch(cluster, project, args.nodes)
            rows.append(("nodectl, unchanged (venv reused)", again, line))
            print(f"nodectl, unchanged: {again:.1f} s; {line}", flush=True)
            requirements.write_text("six==1.17.0\ntorch==2.13.0\n")
            changed, line = nodectl_launch(cluster, project, args.nodes)
            rows.append(("nodectl, six changed", changed, line))
            print(f"nodectl, six changed: {changed:.1f} s; {line}", flush=True)
            # the nodes from nothing again, the controller's cache of wheels kept: what the references get
            wipe(cluster, args.nodes, "nodectl/.nodectl/envs nodectl/.nodectl/objects nodectl/.nodectl/wheels "
                                      "nodectl/.nodectl/uv-cache nodectl/.nodectl/tools")
            requirements.write_text("six==1.16.0\ntorch==2.13.0\n")
            warm, line = nodectl_launch(cluster, project, args.nodes)
            rows.append(("nodectl, from nothing, wheels cached", warm, line))
            print(f"nodectl, from nothing (controller's wheels cached): {warm:.1f} s; {line}", flush=True)
            wheels = sorted((cluster.home / ".cache" / "nodectl" / "wheels").glob("*/wheels"))
            shared = root / "index"
            shared.mkdir()
            for folder in wheels:   # the same wheels nodectl fetched, both versions of six
                for wheel in folder.glob("*.whl"):
                    if not (shared / wheel.name).exists():
                        (shared / wheel.name).hardlink_to(wheel)
            wipe(cluster, args.nodes, "nodectl/.nodectl/envs")   # disk: the references need room for theirs
            server = serve(shared)
            try:
                for parallel in (False, True):
                    requirements.write_text("six==1.16.0\ntorch==2.13.0\n")
                    wipe(cluster, args.nodes, "ref .cache/pip")
                    label = "parallel" if parallel else "sequential"
                    rows.append((f"ssh loop ({label}), from nothing",
                                 reference(cluster, args.nodes, requirements, parallel), ""))
                    print(f"{rows[-1][0]}: {rows[-1][1]:.1f} s", flush=True)
                    requirements.write_text("six==1.17.0\ntorch==2.13.0\n")
                    rows.append((f"ssh loop ({label}), six changed",
                                 reference(cluster, args.nodes, requirements, parallel), ""))
                    print(f"{rows[-1][0]}: {rows[-1][1]:.1f} s", flush=True)
                wipe(cluster, args.nodes, "ref")
            finally:
                server.shutdown()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{args.nodes} isolated nodes, requirements: torch==2.13.0 (CPU) + six; seconds of wall time")
    print("  (a nodectl launch also runs the one-line script; its environment share is the launch's wall time less "
          "that of the launch that reused every venv)")
    best = {kind: min(t for label, t, _ in rows if label.startswith("ssh") and kind in label)
            for kind in ("from nothing", "six changed")}
    run_share = next(t for label, t, _ in rows if "reused" in label)
    for label, seconds, line in rows:
        kind = "from nothing" if "from nothing" in label else "six changed"
        extra = ""
        if label.startswith("nodectl") and "reused" not in label:
            share = seconds - run_share
            extra = f"  environment share {share:5.1f}  (best ssh loop / this: {best[kind] / share:.2f})"
        said = re.sub(r"^environment ", "", line)
        print(f"  {label:38s} {seconds:7.1f}{extra}" + (f"\n      nodectl said: {said}" if said else ""))


if __name__ == "__main__":
    main()
