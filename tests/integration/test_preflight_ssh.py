"""preflight against real sshd nodes (device: cpu), with the gloo collective test through the launch path."""
from __future__ import annotations

import subprocess
import sys

import pytest

from support.cli import run_nodectl
from support.launch import make_project
from support.sshcluster import NODE_PYTHON

pytestmark = pytest.mark.slow

FAKE_TORCH = '''\
__version__ = "2.99.0"
class version:
    cuda = None
    hip = None
class cuda:
    @staticmethod
    def is_available():
        return False
class distributed:
    @staticmethod
    def is_available():
        return False
'''


def python_with(cluster, index: int, name: str, extra_path: str | None = None, bare: bool = False) -> str:
    """A node interpreter that differs, made in the node's own home: a venv without torch (bare) or one that
    sees a fake torch."""
    node = cluster.nodes[index]
    if bare:
        subprocess.run([sys.base_prefix + "/bin/python3", "-m", "venv", "--without-pip", str(node.home_dir / name)],
                       check=True)
        return f"{node.home}/{name}/bin/python"
    return cluster.node_file(index, f"{name}.sh", f"#!/bin/sh\nPYTHONPATH={extra_path} exec {NODE_PYTHON} \"$@\"\n",
                             mode=0o755)


def test_a_socket_ifname_naming_no_interface_fails_quick_preflight_on_that_node(ssh_cluster, tmp_path):
    """It passed the quick tier before, and the full tier said only that the all-reduce job failed."""
    inventory = ssh_cluster.inventory(count=2, node_overrides={1: {"env": {"GLOO_SOCKET_IFNAME": "nosuch0"}}})
    result = run_nodectl(["-i", str(inventory), "--json", "preflight", "--quick"], env=ssh_cluster.env(),
                         cwd=tmp_path)
    assert result.exit_code == 1, result.output[-2000:]
    failed = [r for r in result.json()["results"] if r["verdict"] == "fail"]
    assert [(r["node"], r["check"]) for r in failed] == [("node1", "socket ifname")]
    assert "GLOO_SOCKET_IFNAME=nosuch0: no interface nosuch0 on the node" in failed[0]["detail"]
    assert "lo" in failed[0]["hint"]


def test_full_runs_a_collective_on_each_node_pair(ssh_cluster, tmp_path):
    """A healthy cluster passes every tier: the default checks and its gloo all-reduce over every rank, then a
    collective on each pair of nodes; --quick runs no collective. (Two ranks a node: the container test's default
    preflight, tests/integration/test_containers.py.)"""
    inventory = ssh_cluster.inventory(count=3, gpus=1)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    result = run_nodectl(["-i", str(inventory), "--json", "preflight", "--full"],
                         env={**ssh_cluster.env(), "TMPDIR": str(scratch)}, cwd=tmp_path, timeout=300)
    assert result.exit_code == 0, result.output[-3000:]
    document = result.json()
    assert document["passed"]
    collective = document["collective"]
    assert collective["world"] == 3 and collective["backend"] == "gloo"
    assert all(size["ok"] for size in collective["sizes"]) and collective["sizes"][-1]["busbw_gbs"] > 0
    checks = {(r["node"], r["check"]): r["verdict"] for r in document["results"]}
    assert checks[("node0", "master port")] == "pass" and checks[("node1", "reach master")] == "pass"
    assert checks[("node2", "reach master")] == "pass" and checks[("cluster", "same torch")] == "pass"
    # four collective jobs (the all-reduce, three pairs), and not one of their scratch folders left behind
    assert sorted(p.name for p in scratch.iterdir()) == [], sorted(p.name for p in scratch.iterdir())
    pairs = result.json()["collective"]["pairs"]
    assert [p["nodes"] for p in pairs] == [["node0", "node1"], ["node1", "node2"], ["node2", "node0"]]
    assert all(p["busbw_gbs"] > 0 for p in pairs)
    # remembered in the user's registry: the all-reduce, each pair and the preflight's time (gloo's figures and the
    # time are judged from their third past on)
    assert "figure(s) recorded, without enough past to judge" in result.json()["history"], result.json()["history"]
    shown = run_nodectl(["preflight", "--history", "node1"], env=ssh_cluster.env(), cwd=tmp_path)
    assert shown.exit_code == 0, shown.output
    for part in ("pair node0+node1", "pair node1+node2", "all-reduce of 64 MiB over node0+node1+node2"):
        assert part in shown.stdout, shown.stdout
    assert "pair node0+node2" not in shown.stdout   # node1's parts only
    rows = run_nodectl(["--json", "preflight", "--history", "node1"], env=ssh_cluster.env(), cwd=tmp_path).json()
    assert {r["metric"] for r in rows["rows"]} == {"busbw_gbs", "seconds"}
    assert not any(r["judged"] for r in rows["rows"])
    assert "the full preflight of node0+node1+node2" in [r["label"] for r in rows["rows"] if r["metric"] == "seconds"]

    human = run_nodectl(["-i", str(inventory), "preflight", "--quick"], env=ssh_cluster.env(), cwd=tmp_path)
    assert human.exit_code == 0 and "preflight passed" in human.stdout and "all-reduce" not in human.stdout


def test_node_without_torch_fails_with_hint_and_launch_refuses(ssh_cluster, tmp_path):
    bare = python_with(ssh_cluster, 1, "bare", bare=True)
    inventory = ssh_cluster.inventory(count=2, node_overrides={1: {"python": bare}})
    result = run_nodectl(["-i", str(inventory), "preflight", "--quick"], env=ssh_cluster.env(), cwd=tmp_path)
    assert result.exit_code == 1
    assert "FAIL node1 torch" in result.stdout and "-m pip install torch" in result.stdout

    project = make_project(tmp_path / "project")
    launch = run_nodectl(["-i", str(inventory), "launch", "--", "train.py"], env=ssh_cluster.env(), cwd=project)
    assert launch.exit_code == 1 and "preflight failed, nothing was started" in launch.stderr
    assert not (project / "runs").exists() or not [p for p in (project / "runs").iterdir() if p.name[0].isdigit()]


def test_torch_version_mismatch_between_nodes_fails(ssh_cluster, tmp_path):
    """A torch shadowed through PYTHONPATH: its installed metadata (all --quick reads) says the same version, the
    import (the default tier) does not; the mismatch stops preflight before its collective job."""
    ssh_cluster.node_file(1, "fake/torch/__init__.py", FAKE_TORCH)
    other = python_with(ssh_cluster, 1, "other", extra_path=f"{ssh_cluster.nodes[1].home}/fake")
    inventory = ssh_cluster.inventory(count=2, node_overrides={1: {"python": other}})
    result = run_nodectl(["-i", str(inventory), "--json", "preflight"], env=ssh_cluster.env(), cwd=tmp_path)
    assert result.exit_code == 1
    failed = {r["check"]: r["detail"] for r in result.json()["results"] if r["verdict"] == "fail"}
    assert "2.99.0 on node1" in failed["same torch"]


@pytest.mark.quick
def test_unreachable_node_exits_3_and_the_others_are_checked(ssh_cluster, tmp_path):
    inventory = ssh_cluster.inventory(count=2, extra_nodes=[{"host": "127.0.0.99", "name": "ghost",
                                                             "workdir": "/tmp/ghost"}])
    result = run_nodectl(["-i", str(inventory), "--connect-timeout", "2", "--json", "preflight", "--quick"],
                         env=ssh_cluster.env(), cwd=tmp_path)
    assert result.exit_code == 3
    document = result.json()
    assert "ghost" in document["unreachable"]
    checked = {r["node"] for r in document["results"] if r["check"] == "torch"}
    assert checked == {"node0", "node1"}
