"""What a run would hit that preflight did not read (issue 53), made for real on two isolated nodes, each in a
network and mount namespace of its own: a cache file system out of inodes while it has bytes and strict memory
overcommit on node0 (a tmpfs with few inodes, a sysctl value mounted over /proc/sys/vm in its mount namespace);
the host name mapped to 127.0.1.1 in node1's /etc/hosts and its NCCL_SOCKET_IFNAME naming an interface that is up
but carries no route to node0. Each is named on its node with the cause and the cure; the other node raises none.
Then what fails a collective with the healthy node blamed, named on node1 by the quick tier: its firewall rejecting
the ephemeral ports gloo and NCCL listen on, and a stale /etc/hosts entry for node 0's name."""
from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from support.cli import run_nodectl
from support.sshcluster import namespaced_cluster, netns_available, sshd_available

pytestmark = pytest.mark.slow
SUBNET = "10.79"   # its own: 10.77 (node lost) and 10.78 (environments) run beside it


@pytest.fixture
def cluster(tmp_path):
    if not (sshd_available() and netns_available()):
        pytest.skip("needs openssh-server and network namespaces (root, iproute2)")
    with namespaced_cluster(tmp_path, 2, SUBNET, "lim") as cluster:
        yield cluster


def in_node(cluster, index: int, script: str) -> str:
    done = subprocess.run(["nsenter", "-t", str(cluster.nodes[index].process.pid), "-m", "-n", "--", "sh", "-c",
                           script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_limits_a_run_would_hit_are_named_on_the_node_that_has_them(cluster, tmp_path):
    home = cluster.nodes[0].home
    said = in_node(cluster, 0, f"mkdir -p {home}/.cache && mount -t tmpfs -o size=30g,nr_inodes=64 tiny {home}/.cache"
                               f" && i=0; while touch {home}/.cache/f$i 2>/dev/null; do i=$((i+1)); done; "
                               f"echo 2 > /srv/node/overcommit && mount --bind /srv/node/overcommit "
                               f"/proc/sys/vm/overcommit_memory && df -i {home}/.cache | tail -1")
    assert " 0 100% " in said.replace("  ", " ") or "100%" in said, said
    hostname = socket.gethostname()   # the nodes share this machine's host name (no UTS namespace)
    hosts = Path("/etc/netns/nodectl-lim1/hosts")
    lines = hosts.read_text().splitlines(keepends=True)   # Debian's line, kept in an image, in place of its own
    hosts.write_text("".join([lines[0], f"127.0.1.1 {hostname}\n"] + [line for line in lines[1:]
                                                                        if hostname not in line.split()]))
    in_node(cluster, 1, "ip link add nclimd0 type veth peer name nclimd1 && ip addr add 192.0.2.1/24 dev nclimd0 "
                        "&& ip link set nclimd1 up && ip link set nclimd0 up")   # up, with an address, no route
    inventory = cluster.inventory(node_overrides={1: {"env": {"NCCL_SOCKET_IFNAME": "nclimd0"}}})
    result = run_nodectl(["-i", str(inventory), "--json", "preflight", "--quick"], env=cluster.env(), cwd=tmp_path)
    assert result.exit_code == 1, result.output
    found = {(r["node"], r["check"]): r for r in result.json()["results"]}

    cache = found[("node0", "cache")]
    assert cache["verdict"] == "fail" and f"inodes exhausted on {home}/.cache (df -i)" in cache["detail"], cache
    assert "GiB are free" in cache["detail"] and f"remove small files on {home}/.cache" in cache["hint"]
    overcommit = found[("node0", "overcommit")]
    assert overcommit["verdict"] == "warn" and "vm.overcommit_memory = 2" in overcommit["detail"], overcommit
    assert "sysctl -w vm.overcommit_memory=0" in overcommit["hint"]

    # CPU nodes: gloo binds what the host name resolves to and hands it to node0, which cannot connect to it
    named = found[("node1", "hostname")]
    assert named["verdict"] == "fail", named
    assert f"{hostname} resolves to 127.0.1.1" in named["detail"] and f"'127.0.1.1 {hostname}'" in named["detail"]
    assert "gloo" in named["detail"] and f"reach node1 at {SUBNET}.1.2" in named["detail"], named
    assert f"map {hostname} to {SUBNET}.1.2" in named["hint"] and "GLOO_SOCKET_IFNAME" in named["hint"]
    route = found[("node1", "socket route")]
    assert found[("node1", "socket ifname")]["verdict"] == "pass"   # it exists and is up: all that was read
    assert route["verdict"] == "fail", route
    assert f"NCCL_SOCKET_IFNAME=nclimd0, but the route to {SUBNET}.0.2 through eth0" in route["detail"], route
    assert "(eth0)" in route["hint"]

    for check in ("cache", "overcommit", "hostname", "socket route"):
        assert found[("node0" if check in ("hostname", "socket route") else "node1", check)]["verdict"] == "pass", \
            found[("node0" if check in ("hostname", "socket route") else "node1", check)]
    # node1's bytes free are this machine's disk (a CI runner may hold under 20 GiB): only the inodes are the test's
    assert "inodes" not in found[("node1", "disk")]["detail"], found[("node1", "disk")]


def test_node1s_firewall_and_its_stale_entry_for_node0_are_named_on_node1(cluster, tmp_path):
    """Each fault alone breaks the collective of a plain torchrun while SSH and the master port work; before, the
    quick tier passed the first and blamed node 0's firewall for the second."""
    ns = "nodectl-lim1"
    low, high = (int(w) for w in subprocess.run(["ip", "netns", "exec", ns, "cat",
                                                 "/proc/sys/net/ipv4/ip_local_port_range"],
                                                capture_output=True, text=True, check=True).stdout.split())
    # node1 takes SSH and anything below its ephemeral range; new connections to that range are refused
    reject = ["INPUT", "-p", "tcp", "--syn", "--dport", f"{low}:{high}", "-j", "REJECT", "--reject-with", "tcp-reset"]
    subprocess.run(["ip", "netns", "exec", ns, "iptables", "-A", *reject], check=True)
    try:
        result = run_nodectl(["-i", str(cluster.inventory()), "--json", "preflight", "--quick"], env=cluster.env(),
                             cwd=tmp_path)
    finally:
        subprocess.run(["ip", "netns", "exec", ns, "iptables", "-D", *reject], check=True)
    assert result.exit_code == 1, result.output
    found = {(r["node"], r["check"]): r for r in result.json()["results"]}
    ports = found[("node1", "peer ports")]
    assert ports["verdict"] == "fail", ports
    assert "cannot connect to node1's port" in ports["detail"] and "refused" in ports["detail"], ports
    assert f"open TCP ports {low}-{high}" in ports["hint"] and f"--dport {low}:{high}" in ports["hint"], ports
    assert found[("node0", "peer ports")]["verdict"] == "pass", found[("node0", "peer ports")]
    assert found[("node1", "reach master")]["verdict"] == "pass"   # what passed before: the master port
    assert [r for r in result.json()["results"] if r["verdict"] == "fail"] == [ports]

    # node 0 named by a host name that node1 maps to an address node 0 no longer has (renumbered: .0.9, unused)
    hosts = Path(f"/etc/netns/{ns}/hosts")
    before = hosts.read_text()
    hosts.write_text(before.replace(f"{SUBNET}.0.2 nodectl-node0", f"{SUBNET}.0.9 nodectl-node0"))
    try:
        inventory = cluster.inventory(node_overrides={0: {"addr": "nodectl-node0"}})
        result = run_nodectl(["-i", str(inventory), "--json", "preflight", "--quick"], env=cluster.env(),
                             cwd=tmp_path)
    finally:
        hosts.write_text(before)
    assert result.exit_code == 1, result.output
    found = {(r["node"], r["check"]): r for r in result.json()["results"]}
    stale = found[("node1", "master name")]
    assert stale["verdict"] == "fail", stale
    line = before.splitlines().index(f"{SUBNET}.0.2 nodectl-node0") + 1
    assert f"node1 resolves nodectl-node0 (node0's addr:) to {SUBNET}.0.9" in stale["detail"], stale
    assert f"/etc/hosts line {line}: '{SUBNET}.0.9 nodectl-node0'" in stale["detail"], stale
    assert f"{SUBNET}.0.2" in stale["hint"] and "stale entry" in stale["hint"], stale
    reach = found[("node1", "reach master")]
    assert reach["verdict"] == "fail" and f"resolved on node1 to {SUBNET}.0.9" in reach["detail"], reach
    assert "firewall" not in reach["hint"] and "master name" in reach["hint"], reach
    assert found[("node1", "peer ports")]["verdict"] == "pass"
