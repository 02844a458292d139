"""hosts.yaml `environment:`: a locked venv on every node, built from wheels the controller fetched, for real: two
isolated nodes (their own mount and network namespaces, a firewall that lets nothing out but the cluster's subnet,
so no package index), a requirements file with torch (CPU) and a small pure-Python package."""
from __future__ import annotations

import re
import shutil

import pytest

from support.cli import run_nodectl
from support.launch import kill_leftovers, latest_run_id, make_project
from support.sshcluster import namespaced_cluster, netns_available, sshd_available

pytestmark = pytest.mark.slow

SCRIPT = '''\
import os, sys
import six, torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([dist.get_rank() + 1.0]); dist.all_reduce(total)
print(f"rank={dist.get_rank()} sum={total.item():g} python={sys.executable} six={six.__version__} "
      f"torch={torch.__version__}", flush=True)
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def offline_cluster(tmp_path_factory):
    if not (sshd_available() and netns_available() and shutil.which("iptables")):
        pytest.skip("needs openssh-server, network namespaces and iptables (root)")
    with namespaced_cluster(tmp_path_factory.mktemp("envs"), 2, "10.78", "env", offline=True) as cluster:
        yield cluster


def launch(cluster, project, *extra):
    inventory = cluster.inventory(count=2, environment="requirements.txt", env={"GLOO_SOCKET_IFNAME": "eth0"})
    return run_nodectl(["-i", str(inventory), "launch", "--gpus", "1", *extra, "--", "train.py"],
                       env=cluster.env(), cwd=project, timeout=240)


def built_line(output: str) -> str:
    return next(line for line in output.splitlines() if line.startswith("environment venv "))


@pytest.mark.timeout(600)   # three launches and a preflight in a row: 120 s alone, near 400 beside other files on 2 cores
def test_offline_nodes_build_one_venv_reuse_it_and_rebuild_on_change(offline_cluster, tmp_path):
    cluster, env = offline_cluster, offline_cluster.env()
    project = make_project(tmp_path / "project")
    (project / "train.py").write_text(SCRIPT)
    (project / "requirements.txt").write_text("six==1.16.0\ntorch==2.13.0\n")

    # the nodes cannot reach any index: a plain pip install there fails
    inventory = str(cluster.inventory(count=2))
    offline = run_nodectl(["-i", inventory, "exec", "--timeout", "60", "--", "/opt/venv/bin/python", "-m", "pip",
                           "download", "--no-deps", "--index-url", "https://pypi.org/simple", "-d", "/tmp/x", "six"],
                          env=env, cwd=project)
    assert offline.exit_code == 1, offline.output

    first = launch(cluster, project)
    run_id = latest_run_id(project)
    try:
        assert first.exit_code == 0, first.output
        line = built_line(first.stderr)
        assert "built on node0, node1" in line and "wheels fetched" in line and " uv," in line, line
        key = re.search(r"venv ([0-9a-f]{16})", line)[1]
        assert "six=1.16.0 torch=2.13.0" in first.stdout
        assert f"/nodectl/.nodectl/envs/{key}/bin/python" in first.stdout   # rank 0 ran the venv's python
        for rank in (1,):
            tail = run_nodectl(["tail", f"rank{rank}"], env=env, cwd=project)
            assert f"envs/{key}/bin/python six=1.16.0" in tail.stdout and "sum=3" in tail.stdout
    finally:
        kill_leftovers(run_id)

    # someone changes the venv on node1 by hand: preflight names it, the launch sets it aside and rebuilds it
    # there, and reuses node0's as it is
    site = next((cluster.nodes[1].workdir / ".nodectl" / "envs" / key / "lib").glob("python3*/site-packages"))
    (site / "six.py").write_text((site / "six.py").read_text() + "\n# patched by hand\n")
    unpacked = {p: p.stat().st_ino for p in (cluster.nodes[1].workdir / ".nodectl" / "uv-cache").rglob("six.py")}
    assert unpacked   # uv's copy of six, unpacked there for the first build
    checked = run_nodectl(["--json", "-i", str(cluster.inventory(count=2, environment="requirements.txt")),
                           "preflight", "--quick"], env=env, cwd=project, timeout=300)
    verdicts = {(r["check"], r["node"]): r for r in checked.json()["results"]}
    assert verdicts[("environment", "node1")]["verdict"] == "fail"
    assert "six.py" in verdicts[("environment", "node1")]["detail"]
    assert verdicts[("environment", "node0")]["verdict"] == "pass"
    assert checked.exit_code == 1
    repaired = launch(cluster, project, "--skip-preflight")
    assert repaired.exit_code == 0, repaired.output
    assert "node1: its venv" in repaired.stderr and "set aside" in repaired.stderr
    line = built_line(repaired.stderr)   # node0's venv is reused as it is, and nothing travels for node1's
    assert f"venv {key}" in line and "built on node1 " in line and "node0" not in line, line
    assert "(0 B sent)" in line, line
    assert "# patched by hand" not in (site / "six.py").read_text()
    # the venv held copies, so the edit never reached uv's cache: the rebuild took what uv had unpacked
    assert {p: p.stat().st_ino for p in unpacked if p.exists()} == unpacked

    # one package changes: a new venv, and only that package's wheel travels (node0's; one node is enough)
    (project / "requirements.txt").write_text("six==1.17.0\ntorch==2.13.0\n")
    changed = launch(cluster, project, "--skip-preflight", "--nodes", "1")
    assert changed.exit_code == 0, changed.output
    line = built_line(changed.stderr)
    new_key = re.search(r"venv ([0-9a-f]{16})", line)[1]
    assert new_key != key and "built on node0 " in line and "node1" not in line, line
    amount, unit = re.search(r"([0-9.]+) (B|KiB|MiB|GiB) sent\)", line).groups()
    assert unit in ("B", "KiB") or unit == "MiB" and float(amount) < 5, line   # only six's new wheel travelled
    assert "six=1.17.0" in changed.stdout
