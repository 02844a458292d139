"""Hardware that fails while a run runs, on isolated SSH nodes (issue 68): node1 is given two GPUs (a fake NVML in
place of nvidia-ml-py's pynvml), a kernel log and an InfiniBand port (files mounted over /dev/kmsg and
/sys/class/infiniband inside its own mount namespace), then its parts fail under a running launch. nodectl's
code is the same as on a real node: it imports pynvml, reads /dev/kmsg and sysfs."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.cli import run_nodectl
from support.launch import kill_leftovers, latest_run_id, wait_for
from support.sshcluster import running_cluster

pytestmark = pytest.mark.slow

STEADY = """\
import os, time
for step in range(240):
    print(f"rank {os.environ['RANK']} step {step}", flush=True)
    time.sleep(0.5)
"""
GPUS = [{"pci": "00000000:3B:00.0", "uuid": "GPU-node1-0", "ecc_uncorrected": 0, "ecc_corrected": 0},
        {"pci": "00000000:5E:00.0", "uuid": "GPU-node1-1", "ecc_uncorrected": 0, "ecc_corrected": 0}]
PORT = ("symbol_error", "link_error_recovery", "link_downed", "port_rcv_errors", "local_link_integrity_errors",
        "excessive_buffer_overrun_errors")


def _give_parts(cluster, index: int) -> dict:
    """Node `index`'s fake GPUs, kernel log and port, mounted where nodectl reads them; returns the host paths."""
    fake = Path(__file__).resolve().parents[1] / "support" / "fake_pynvml.py"
    home = cluster.nodes[index].home
    module = cluster.node_file(index, "parts/pynvml.py", fake.read_text())
    cluster.node_file(index, "parts/nvml.json", json.dumps({"gpus": GPUS}))
    stamp = int((time.monotonic() - 30) * 1e6)   # an Xid from before the run: never its event
    cluster.node_file(index, "parts/kmsg", f"3,1,{stamp},-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, old\n")
    for name in PORT:
        cluster.node_file(index, f"parts/ib/mlx5_0/ports/1/counters/{name}", "0\n")
    site = f"/opt/venv/lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages/pynvml.py"
    staged = cluster.on_node(index, " && ".join([
        f"mount --bind {module} {site}", f"mount --bind {home}/parts/kmsg /dev/kmsg",
        "mkdir -p /srv/sysclass", "mount --bind /sys/class /srv/sysclass", "mount -t tmpfs parts /sys/class",
        "for e in /srv/sysclass/*; do ln -s \"$e\" /sys/class/; done",
        f"ln -s {home}/parts/ib /sys/class/infiniband", f"ln -s {home}/parts/nvml.json /tmp/fake-nvml.json"]))
    assert staged.returncode == 0, staged.stderr
    host = cluster.nodes[index].home_dir / "parts"
    return {"nvml": host / "nvml.json", "kmsg": host / "kmsg", "port": host / "ib/mlx5_0/ports/1/counters"}


def _set_gpu(parts: dict, index: int, **values) -> None:
    GPUS[index].update(values)
    tmp = parts["nvml"].with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpus": GPUS}))
    tmp.replace(parts["nvml"])


@pytest.mark.timeout(400)
def test_parts_that_fail_mid_run_are_named_within_60s_the_broken_gpu_ends_the_run_and_history_keeps_them(
        tmp_path_factory, tmp_path):
    with running_cluster(tmp_path_factory, 2, first_octet=44) as cluster:
        parts = _give_parts(cluster, 1)
        project = tmp_path / "project"
        project.mkdir()
        (project / "steady.py").write_text(STEADY)
        inventory = str(cluster.inventory(device="cuda"))
        env = cluster.env()
        launch = subprocess.Popen([sys.executable, "-m", "nodectl", "-i", inventory, "launch", "--skip-preflight",
                                   "--", "steady.py"], env=env, cwd=project, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        run_id = wait_for(lambda: (project / "runs").is_dir() and latest_run_id(project), timeout=60)
        try:
            wait_for(lambda: "step 4" in run_nodectl(["tail", "rank1"], env=env, cwd=project).stdout, timeout=90,
                     interval=1)
            status = run_nodectl(["status"], env=env, cwd=project)
            assert "hardware:" not in status.stdout, "the counts a run starts with and older Xids are no event"

            # what only slows a part: named, the run goes on
            _set_gpu(parts, 1, ecc_corrected=5)
            (parts["port"] / "symbol_error").write_text("17\n")
            began = time.monotonic()
            shown = ""
            while time.monotonic() - began < 60 and not ("symbol errors" in shown and "corrected ECC" in shown):
                time.sleep(1)
                shown = run_nodectl(["status"], env=env, cwd=project).output
            print(f"\nnamed by status in {time.monotonic() - began:.1f} s")
            assert "hardware: GPU 1 of node1: corrected ECC errors rose by 5 to 5 since the run started" in shown
            assert "hardware: port mlx5_0/1 of node1: symbol errors rose by 17 to 17 since the run started" in shown
            assert "cannot go on" not in shown
            top = run_nodectl(["--json", "top", "--once"], env=env, cwd=project).json()
            assert {(e["node"], e["part"], e["counter"], e["rise"], e["fatal"]) for e in top["hardware"]} == {
                ("node1", "GPU 1", "corrected ECC errors", 5, False),
                ("node1", "port mlx5_0/1", "symbol errors", 17, False)}

            # GPU 0 falls off the bus: the run ends on it, named as the cause
            with parts["kmsg"].open("a") as log:
                log.write(f"3,2,{int(time.monotonic() * 1e6)},-;NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, "
                          f"name=python, GPU has fallen off the bus.\n")
            _set_gpu(parts, 1, lost=True)
            broke = time.monotonic()
            out, err = launch.communicate(timeout=120)
            ended = time.monotonic() - broke
        finally:
            if launch.poll() is None:
                launch.kill()
            kill_leftovers(run_id)
        print(f"run ended {ended:.1f} s after the GPU broke")
        said = out + err
        assert launch.returncode == 1, said[-3000:]
        assert ended < 60, said[-3000:]
        # the attached launch told each event once as it came
        assert said.count("hardware: port mlx5_0/1 of node1: symbol errors rose by 17") == 1, said[-3000:]
        assert "hardware: GPU 1 of node1: corrected ECC errors rose by 5" in said
        assert re.search(r"hardware: GPU 0 of node1: 1 Xid 79 \(GPU has fallen off the bus\) since the run "
                         r"started, last \d+s ago: the part cannot go on", said), said[-3000:]
        assert "hardware: GPU 1 of node1 lost (NVML: GPU is lost)" in said
        manifest = json.loads((project / "runs" / run_id / "manifest.json").read_text())
        assert manifest["failure"]["kind"] == "hardware" and manifest["failure"]["node"] == "node1", manifest
        assert "of node1" in manifest["failure"]["description"]

        history = run_nodectl(["--json", "preflight", "--history", "node1"], env=env, cwd=project).json()
        kept = {(e["part"], e["counter"], e["fatal"]) for e in history["events"] if e["event"] == "hardware"}
        assert {("GPU 0", "Xid 79 (GPU has fallen off the bus)", True), ("GPU 1", "lost", True),
                ("port mlx5_0/1", "symbol errors", False), ("GPU 1", "corrected ECC errors", False)} <= kept
        table = run_nodectl(["preflight", "--history", "node1"], env=env, cwd=project)
        assert "hardware: GPU 0: 1 Xid 79 (GPU has fallen off the bus) (stopped the run)" in table.stdout
