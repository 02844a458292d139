"""The test nodes prove they are themselves: a node whose address another SSH server answers on fails at once,
saying the address is taken, instead of talking to that server (and failing later with "HOST KEY CHANGED")."""
from __future__ import annotations

import subprocess

import pytest

from support.sshcluster import make_cluster
from support.sshcluster import NodeSpec, SSHCluster, SSHNode, _keygen, host_keys


def test_a_node_whose_address_another_sshd_answers_is_refused(tmp_path_factory, tmp_path):
    squatter = make_cluster(tmp_path_factory, 1, first_octet=70)
    try:
        held = squatter.nodes[0]
        theirs = open(f"{held.host_key}.pub").read().split()[1]
        assert host_keys(held.address, held.port) == [theirs]
        # our node's sshd is up (a process that lives) but the address answers with the squatter's key: the
        # moment before a server that could not bind exits, or a program that holds the port for good
        mine = SSHNode("node0", held.address, held.port, tmp_path / "node0", NodeSpec())
        mine.root.mkdir()
        _keygen(mine.host_key, "host-node0")
        (mine.root / "sshd.log").write_text("")
        mine.process = subprocess.Popen(["sleep", "30"])
        try:
            with pytest.raises(RuntimeError, match="is taken by another server") as raised:
                SSHCluster(tmp_path, count=1)._wait_up(mine)
            assert f"{held.address}:{held.port}" in str(raised.value)
        finally:
            mine.process.kill()
        assert host_keys(held.address, held.port) == [theirs], "the squatter is untouched"
    finally:
        squatter.stop()


def test_the_transport_names_the_host_key_it_verified(ssh_cluster, tmp_path, monkeypatch):
    """Preflight's history keys a GPU by its node's name and the host key the connection verified (round four: a
    node's own word on its GPUs' UUIDs can be forged): the key named is the node's own."""
    from nodectl.inventory import load_inventory
    from nodectl.transport.channels import SSHTransport, TransportOptions

    monkeypatch.setenv("HOME", str(ssh_cluster.home))   # the controller's ~/.ssh: known_hosts and the key
    inventory = load_inventory(ssh_cluster.inventory(tmp_path / "hosts.yaml", count=2))
    for node, simulated in zip(inventory.nodes, ssh_cluster.nodes):
        shown = subprocess.run(["ssh-keygen", "-lf", f"{simulated.host_key}.pub"], capture_output=True, text=True,
                               check=True).stdout.split()[1]
        transport = SSHTransport(node, TransportOptions())
        try:
            assert transport.host_key() is not None and transport.host_key().endswith(" " + shown), shown
        finally:
            transport.close()


def test_a_stream_whose_node_writes_to_stderr_waits_without_spinning(ssh_cluster, tmp_path, monkeypatch):
    """paramiko's channel is readable while stdout or stderr holds data: stderr left unread (a login shell's
    banner, as on node0) made the watch's every select return at once, and an attached launch of two such nodes
    burned 42 s of the controller's CPU in 36 s of a sleeping run. The reader now drains stderr and keeps its tail."""
    import time

    from nodectl.inventory import load_inventory
    from nodectl.transport.channels import SSHTransport, TransportOptions

    monkeypatch.setenv("HOME", str(ssh_cluster.home))
    node = load_inventory(ssh_cluster.inventory(tmp_path / "hosts.yaml", count=1)).nodes[0]
    transport = SSHTransport(node, TransportOptions())
    try:
        stream = transport.open_lines(["sh", "-c", "echo 'said on stderr' >&2; sleep 4; echo 'the line'"])
        try:
            began, cpu = time.monotonic(), time.thread_time()
            while time.monotonic() - began < 2.5:   # nothing on stdout but the banner: each read waits its time out
                line = stream.readline(0.5)
                assert line is None or b"Welcome to node0" in line, line
            assert time.thread_time() - cpu < 0.5, "the reader spun while the node was silent on stdout"
            assert stream.readline(10) == b"the line"
            assert b"said on stderr" in stream.stderr
        finally:
            stream.close()
    finally:
        transport.close()
