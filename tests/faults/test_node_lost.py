"""A node lost mid-run: every simulated node lives in its own network namespace (veth pair, sshd inside), and
one link is cut while the run is attached."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_nodectl
from launch_helpers import kill_leftovers, latest_run_id, run_processes, wait_for
from sshcluster import SSHCluster, sshd_available

pytestmark = pytest.mark.slow
SUBNET = "10.77"
RING = '''\
import datetime, os, time, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ["COLLECTIVE_TIMEOUT"])))
step = 0
while True:
    dist.all_reduce(torch.ones(1))
    step += 1
    if step % 10 == 0:
        print(f"rank {dist.get_rank()} step {step}", flush=True)
    time.sleep(0.1)
'''


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def netns_available() -> bool:
    if not shutil.which("ip"):
        return False
    probe = subprocess.run(["ip", "netns", "add", "nodectl-probe"], capture_output=True)
    subprocess.run(["ip", "netns", "del", "nodectl-probe"], capture_output=True)
    return probe.returncode == 0


@pytest.fixture
def namespaced_cluster(tmp_path):
    if not (sshd_available() and netns_available()):
        pytest.skip("needs openssh-server and network namespaces (root, iproute2)")
    names = ["nodectl-ns0", "nodectl-ns1"]
    forward = Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()
    try:
        for k, ns in enumerate(names):
            host_if, node_if = f"nctl-h{k}", f"nctl-n{k}"
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", node_if)
            sh("ip", "link", "set", node_if, "netns", ns)
            sh("ip", "addr", "add", f"{SUBNET}.{k}.1/24", "dev", host_if)
            sh("ip", "link", "set", host_if, "up")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", node_if, "name", "eth0")
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{SUBNET}.{k}.2/24", "dev", "eth0")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            sh("ip", "netns", "exec", ns, "ip", "route", "add", "default", "via", f"{SUBNET}.{k}.1")
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1")  # the namespaces reach each other through here
        cluster = SSHCluster(tmp_path, count=2, addresses=[f"{SUBNET}.{k}.2" for k in range(2)],
                             namespaces=names).start()
        cluster.trust_host_keys()
        yield cluster
        cluster.stop()
    finally:
        Path("/proc/sys/net/ipv4/ip_forward").write_text(forward)
        for k, ns in enumerate(names):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            subprocess.run(["ip", "link", "del", f"nctl-h{k}"], capture_output=True)


def test_a_cut_link_is_reported_as_a_lost_node_and_cleaned_up_after(namespaced_cluster, tmp_path):
    cluster = namespaced_cluster
    project = tmp_path / "project"
    project.mkdir()
    (project / "ring.py").write_text(RING)
    inventory = str(cluster.inventory(env={"GLOO_SOCKET_IFNAME": "eth0", "COLLECTIVE_TIMEOUT": "25"}))
    env = cluster.env()
    controller = subprocess.Popen([sys.executable, "-m", "nodectl", "-i", inventory, "--connect-timeout", "3",
                                   "launch", "--skip-preflight", "--grace", "2", "--", "ring.py"], env=env,
                                  cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_id = wait_for(lambda: (project / "runs").is_dir() and any((project / "runs").iterdir())
                      and latest_run_id(project))
    log = cluster.nodes[1].workdir / "runs" / run_id / "logs" / "rank1.log"
    try:
        wait_for(lambda: log.exists() and "step 20" in log.read_text(), timeout=90)
        sh("ip", "link", "set", "nctl-h1", "down")
        cut = time.monotonic()
        out, err = controller.communicate(timeout=120)
        detected = time.monotonic() - cut
        print(f"\nlink cut -> run ended (node lost, survivors stopped): {detected:.1f}s")
        assert controller.returncode == 1, err
        assert "node node1 was lost" in err
        assert detected < 3 + 5 + 10  # connect timeout + a few polls + stopping the survivors
        manifest = json.loads((project / "runs" / run_id / "manifest.json").read_text())
        assert manifest["failure"]["kind"] == "lost" and manifest["failure"]["node"] == "node1"
        node0 = [p for p in run_processes(run_id) if p.environ().get("NODECTL_NODE_RANK") == "0"]
        assert node0 == []  # the survivors were stopped

        sh("ip", "link", "set", "nctl-h1", "up")
        stopped = run_nodectl(["-i", inventory, "stop", "--grace", "1"], env=env, cwd=project, timeout=120)
        assert stopped.exit_code == 0, stopped.output
        assert run_processes(run_id) == []
        status = run_nodectl(["-i", inventory, "--json", "status"], env=env, cwd=project)
        assert status.exit_code == 0
        assert {r["node"] for r in status.json()["ranks"]} == {"node0", "node1"}
        assert all(r["state"] != "running" for r in status.json()["ranks"])
    finally:
        controller.kill()
        subprocess.run(["ip", "link", "set", "nctl-h1", "up"], capture_output=True)
        kill_leftovers(run_id)
