"""Preflight on isolated SSH nodes broken the way real ones are (issue 41): a per-node env: that the ranks get,
a package that differs in one node's Python, a full /tmp in one node's mount namespace, and one node's logins in
a 1 GiB memory cgroup. Each is named with its node, cause and cure; the healthy nodes raise no new alarm."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from support.cli import run_nodectl

from support.sshcluster import running_cluster
from test_preflight_ssh import python_with

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory, 2, first_octet=90) as cluster:
        yield cluster


def preflight(cluster, tmp_path, **inventory) -> tuple[int, dict]:
    result = run_nodectl(["-i", str(cluster.inventory(**inventory)), "--json", "preflight", "--quick"],
                         env=cluster.env(), cwd=tmp_path)
    document = result.json()
    return result.exit_code, {(r["node"], r["check"]): r for r in document["results"]}


def test_what_the_ranks_get_is_judged_not_a_stand_in(cluster, tmp_path):
    code, healthy = preflight(cluster, tmp_path)
    assert code == 0
    for node in ("node0", "node1"):
        assert healthy[(node, "cgroup limits")]["verdict"] == "pass"
        assert healthy[(node, "tmp")]["verdict"] == "pass" and "/tmp writable" in healthy[(node, "tmp")]["detail"]
    assert healthy[("cluster", "same packages")]["verdict"] == "pass"
    assert healthy[("cluster", "same NCCL/torch env")]["verdict"] == "pass"

    # a per-node env: in hosts.yaml is what node1's ranks get: the login environments alone agree
    code, found = preflight(cluster, tmp_path, node_overrides={1: {"env": {"NCCL_IB_DISABLE": "1"}}})
    env = found[("cluster", "same NCCL/torch env")]
    assert env["verdict"] == "warn" and "NCCL_IB_DISABLE: 1 on node1; unset on node0" in env["detail"]

    # node1's TMPDIR under a scratch mount that is not there, its HF_HOME not made yet (issue 70): the first fails
    # with what is missing, the second passes (the library makes it), and preflight made neither
    home, seen = cluster.nodes[1].home, cluster.nodes[1].home_dir
    code, found = preflight(cluster, tmp_path, node_overrides={1: {"env": {"TMPDIR": f"{home}/scratch/tmp",
                                                                           "HF_HOME": f"{home}/hf"}}})
    tmp, cache = found[("node1", "tmp")], found[("node1", "cache")]
    assert code == 1 and tmp["verdict"] == "fail" and f"{home}/scratch/tmp does not exist" in tmp["detail"], tmp
    assert "TMPDIR elsewhere" in str(tmp) and found[("node0", "tmp")]["verdict"] == "pass"
    assert cache["verdict"] == "pass" and f"{home}/hf does not exist yet" in cache["detail"], cache
    assert not (seen / "scratch").exists() and not (seen / "hf").exists()

    # a package that differs in node1's Python: named with the node and the version on each side
    drift = cluster.nodes[1].home_dir / "drift"
    info = drift / "nodectl_drift_probe-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nodectl-drift-probe\nVersion: 1.0\n")
    wrapper = python_with(cluster, 1, "drifted", extra_path=f"{cluster.nodes[1].home}/drift")
    code, found = preflight(cluster, tmp_path, node_overrides={1: {"python": wrapper}})
    packages = found[("cluster", "same packages")]
    assert packages["verdict"] == "warn" and "nodectl-drift-probe 1.0 on node1; missing on node0" in packages["detail"]


def test_a_full_tmp_on_one_node_fails_there(cluster, tmp_path):
    """/tmp full in node0's own mount namespace: Python's tempfile would fall back to /var/tmp and pass; gcc,
    Triton and mktemp would not, and neither does preflight."""
    node = cluster.nodes[0]
    filled = subprocess.run(["nsenter", "-t", str(node.process.pid), "-m", "--", "sh", "-c",
                             "mount -o remount,size=256k /tmp && dd if=/dev/zero of=/tmp/fill bs=64k count=64 "
                             "2>/dev/null; df -k /tmp | tail -1"], capture_output=True, text=True)
    assert filled.returncode == 0, filled.stderr
    code, found = preflight(cluster, tmp_path)
    assert code == 1
    tmp = found[("node0", "tmp")]
    assert tmp["verdict"] == "fail" and "/tmp cannot be written" in tmp["detail"] and "No space left" in tmp["detail"]
    assert "TMPDIR" in tmp["hint"] and found[("node1", "tmp")]["verdict"] == "pass"


def _memory_cgroup(name: str) -> Path | None:
    """A new memory cgroup below this process's own (v1, or v2 with the memory controller delegated), or None."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            base, limit = Path("/sys/fs/cgroup/memory" + path), "memory.limit_in_bytes"
        elif controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            base, limit = Path("/sys/fs/cgroup" + path), "memory.max"
        else:
            continue
        folder = base / name
        try:
            folder.mkdir(exist_ok=True)
            (folder / limit).write_text(str(1 << 30))
            return folder
        except OSError:
            return None
    return None


def test_logins_in_a_1_gib_memory_cgroup_fail_on_that_node(cluster, tmp_path):
    folder = _memory_cgroup(f"nodectl-test-{os.getpid()}")
    if folder is None:
        pytest.skip("no memory cgroup can be made here")
    try:
        (folder / "cgroup.procs").write_text(str(cluster.nodes[1].process.pid))  # its sessions are born in it
        code, found = preflight(cluster, tmp_path)
        limits = found[("node1", "cgroup limits")]
        assert code == 1 and limits["verdict"] == "fail", limits
        assert "the ranks may use 1.0 GiB of memory" in limits["detail"] and folder.name in limits["detail"]
        assert found[("node0", "cgroup limits")]["verdict"] == "pass"
    finally:
        cluster.stop()
        for pid in (folder / "cgroup.procs").read_text().split():
            try:
                (folder.parent / "cgroup.procs").write_text(pid)
            except OSError:
                pass
        folder.rmdir()
