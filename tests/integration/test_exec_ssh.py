"""`nodectl exec` on the isolated cluster: node0 root with a noisy bash start-up, node1 zsh without sftp, node2 fish."""
from __future__ import annotations

import pytest

import psutil

from support.cli import run_nodectl
from support.launch import wait_for


@pytest.mark.quick
def test_identical_output_is_grouped_and_banners_stay_out(ssh_cluster, tmp_path):
    env, inventory = ssh_cluster.env(), str(ssh_cluster.inventory(count=3))
    same = run_nodectl(["-i", inventory, "exec", "--", "printf", "%s|", "a b", "$HOME", "it's\\n"], env=env,
                       cwd=tmp_path)
    assert same.exit_code == 0, same.output
    assert "node[0-2] (3 nodes)" in same.stdout
    assert same.stdout.count("a b|$HOME|it's\\n|") == 1  # every word intact, printed once for the three nodes
    assert "Welcome to" not in same.output and "rc on stderr" not in same.output  # node0/1's start-up banners
    homes = run_nodectl(["-i", inventory, "--json", "exec", "echo $HOME"], env=env, cwd=tmp_path)
    nodes = homes.json()["nodes"]
    assert [nodes[f"node{i}"]["stdout"] for i in range(3)] == ["/root\n", "/home/nodectl-zsh\n",
                                                                "/home/nodectl-fish\n"]
    assert len(homes.json()["groups"]) == 3


def test_exit_codes_per_node_and_unreachable_nodes(ssh_cluster, tmp_path):
    env = ssh_cluster.env()
    inventory = str(ssh_cluster.inventory(count=3))
    result = run_nodectl(["-i", inventory, "--json", "exec", "--", "sh", "-c", 'test "$(id -u)" = 0'], env=env,
                         cwd=tmp_path)
    assert result.exit_code == 1
    assert {name: entry["exit"] for name, entry in result.json()["nodes"].items()} == \
        {"node0": 0, "node1": 1, "node2": 1}
    assert any(g["nodes"] == "node[1-2]" for g in result.json()["groups"])
    dead = str(ssh_cluster.inventory(tmp_path / "dead.yaml", count=1,
                                     extra_nodes=[{"host": "127.0.0.254", "name": "gone"}]))
    result = run_nodectl(["-i", dead, "--connect-timeout", "2", "exec", "true"], env=env, cwd=tmp_path)
    assert result.exit_code == 3 and "gone: unreachable" in result.stdout


def test_stdin_only_when_asked_and_a_timeout_leaves_nothing_behind(ssh_cluster, tmp_path):
    env, inventory = ssh_cluster.env(), str(ssh_cluster.inventory(count=2))
    closed = run_nodectl(["-i", inventory, "exec", "--timeout", "20", "cat"], env=env, cwd=tmp_path, input="secret")
    assert closed.exit_code == 0 and "secret" not in closed.stdout  # no hang: cat sees end of input at once
    given = run_nodectl(["-i", inventory, "exec", "--stdin", "cat"], env=env, cwd=tmp_path, input="hello\n")
    assert given.exit_code == 0 and given.stdout.count("hello") == 1 and "node[0-1] (2 nodes)" in given.stdout
    # a command that ends without reading its input: its exit is the answer, not a lost connection (this race
    # once made a node's first runctl call, answered "not installed" at once, look unreachable)
    ignored = run_nodectl(["-i", inventory, "exec", "--stdin", "--", "echo", "done"], env=env, cwd=tmp_path,
                          input="x" * (8 << 20))
    assert ignored.exit_code == 0 and "done" in ignored.stdout and "lost" not in ignored.output, ignored.output
    slow = run_nodectl(["-i", inventory, "--json", "exec", "--timeout", "1", "--", "sleep", "37.5"], env=env,
                       cwd=tmp_path)
    assert slow.exit_code == 1
    assert all("timed out after 1s" in entry["error"] for entry in slow.json()["nodes"].values())
    wait_for(lambda: not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "37.5"]],
             timeout=10)
