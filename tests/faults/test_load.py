"""Load: 64 loopback SSH nodes for env-dump and quick preflight; 3 runs at once stopped one by one.
Heavy for a 2-core CI machine: runs only with NODECTL_LOAD=1 (figures in docs/RELIABILITY.md)."""
from __future__ import annotations

import json
import os
import time

import pytest

from support.cli import run_nodectl
from support.launch import kill_leftovers, run_processes, wait_for
from support.sshcluster import SSHCluster

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.environ.get("NODECTL_LOAD") != "1",
                                                   reason="load test: set NODECTL_LOAD=1")]


@pytest.fixture(scope="module")
def big_cluster(tmp_path_factory):
    cluster = SSHCluster(tmp_path_factory.mktemp("load"), count=64, first_octet=100).start()
    cluster.trust_host_keys()
    yield cluster
    cluster.stop()


def test_64_nodes_env_dump_and_quick_preflight(big_cluster, tmp_path):
    inventory = str(big_cluster.inventory())
    started = time.monotonic()
    dump = run_nodectl(["-i", inventory, "--json", "env-dump"], env=big_cluster.env(), cwd=tmp_path, timeout=600)
    dump_s = time.monotonic() - started
    assert dump.exit_code == 0, dump.output[-2000:]
    assert len(dump.json()["nodes"]) == 64
    started = time.monotonic()
    preflight = run_nodectl(["-i", inventory, "--json", "preflight", "--quick"], env=big_cluster.env(), cwd=tmp_path,
                            timeout=900)
    preflight_s = time.monotonic() - started
    assert preflight.exit_code == 0, preflight.output[-3000:]
    document = preflight.json()
    assert {r["node"] for r in document["results"] if r["check"] == "torch"} == {f"node{i}" for i in range(64)}
    print(f"\n64 nodes: env-dump {dump_s:.1f}s, quick preflight {preflight_s:.1f}s")


def test_three_runs_at_once_stopped_independently(big_cluster, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "sleepy.py").write_text("import time, torch.distributed as d\nd.init_process_group('gloo')\n"
                                       "print('up', flush=True)\ntime.sleep(300)\n")
    inventory = str(big_cluster.inventory(count=4))
    runs = []
    for _ in range(3):
        result = run_nodectl(["-i", inventory, "launch", "--skip-preflight", "--detach", "--", "sleepy.py"],
                             env=big_cluster.env(), cwd=project)
        assert result.exit_code == 0, result.output
        runs.append(sorted(p.name for p in (project / "runs").iterdir() if p.name[0].isdigit())[-1])
        time.sleep(1.1)
    ports = {json.loads((project / "runs" / r / "manifest.json").read_text())["plan"]["master_port"] for r in runs}
    assert len(ports) == 3
    try:
        for run in runs:
            wait_for(lambda: len(run_processes(run)) >= 8, timeout=120)
        for index, run in enumerate(runs):
            assert run_nodectl(["stop", "--run", run, "--grace", "2"], env=big_cluster.env(), cwd=project).exit_code == 0
            assert run_processes(run) == []
            for other in runs[index + 1:]:
                assert len(run_processes(other)) >= 8
    finally:
        for run in runs:
            kill_leftovers(run)
