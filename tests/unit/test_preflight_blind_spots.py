"""Preflight judges what a node really gives a run, not what a fallback reports (issue 41), on saved and crafted
node answers: the temp folder the ranks' tools use, the cgroup the ranks run in, the environment they get, the
cure for the cause, the node that differs, and one broken GPU that must not hide the rest."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nodectl.preflight import cluster, judge
from nodectl.preflight.judge import Expectation, NodeFacts
from nodectl.preflight.verdict import FAIL, PASS, SKIP, WARN
from nodectl.remote.probe_nodes import probe_source, with_environment
from test_preflight_checks import healthy_report

REPO = Path(__file__).resolve().parents[2]


def by_check(report, gpus=8, device="cuda"):
    facts = NodeFacts("n0", report, device, Expectation(gpus, None, "10.0.1.11"))
    return {r.check: r for r in judge.judge_node(facts, tier="quick")}


def run_probe(env: dict | None = None, extra_env: dict | None = None) -> dict:
    """The real probe, as preflight sends it (the ranks' env: laid over the login's)."""
    source = with_environment(probe_source(), env or {})
    proc = subprocess.run([sys.executable, "-", str(REPO), "--no-import-torch"], input=source, capture_output=True,
                          text=True, env={**os.environ, **(extra_env or {})}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_temp_folder_is_the_ranks_tmpdir_and_a_full_one_fails(tmp_path):
    """tempfile.gettempdir() passes over a full /tmp to /var/tmp; gcc, Triton and mktemp do not. The probe looks
    at $TMPDIR (from the ranks' env:) else /tmp, and proves room with a real write."""
    scratch = tmp_path / "scratch"
    report = run_probe({"TMPDIR": str(scratch)})
    assert report["disk"]["scratch"]["tmp"]["path"] == str(scratch) and report["disk"]["scratch"]["tmp"]["writable"]
    assert report["env"]["TMPDIR"] == str(scratch), "the report's env is the ranks' env"
    unset = {k: v for k, v in os.environ.items() if k != "TMPDIR"}
    proc = subprocess.run([sys.executable, "-", "~", "--no-import-torch"], input=probe_source(), capture_output=True,
                          text=True, env=unset, timeout=120)
    assert json.loads(proc.stdout.splitlines()[-1])["disk"]["scratch"]["tmp"]["path"] == "/tmp"
    full = healthy_report()
    full["disk"]["scratch"]["tmp"] = {"path": "/tmp", "writable": False,
                                      "write_error": "OSError: No space left on device", "free_bytes": 0}
    found = by_check(full)["tmp"]
    assert found.verdict == FAIL and "/tmp cannot be written" in found.detail and "No space left" in found.detail
    assert "TMPDIR" in found.hint


@pytest.mark.parametrize("cgroup, ranks, verdict, words", [
    ({"memory": {"limit": 1 << 30, "file": "/sys/fs/cgroup/user.slice/memory.max"}}, 1, FAIL,
     "the ranks may use 1.0 GiB of memory (/sys/fs/cgroup/user.slice/memory.max), 1 rank(s) here"),
    ({"memory": {"limit": 12 << 30, "file": "/sys/fs/cgroup/memory/x/memory.limit_in_bytes"}}, 2, WARN,
     "memory limited to 12.0 GiB of the machine's 24.0 GiB"),
    ({"cpu": {"limit": 0.5, "file": "/sys/fs/cgroup/cpu.max"}}, 2, WARN, "CPU quota of 0.5 CPU(s) for 2 rank(s)"),
    ({}, 2, PASS, "none below the machine's"),
])
def test_the_cgroup_the_ranks_run_in(cgroup, ranks, verdict, words):
    report = healthy_report()
    report["memory"] = {"total_bytes": 24 << 30}
    report["cgroup"] = {"version": 2, **cgroup}
    found = by_check(report, gpus=ranks)["cgroup limits"]
    assert found.verdict == verdict and words in found.detail, found
    if verdict != PASS:
        assert "MemoryMax" in found.hint
    report.pop("cgroup")
    assert by_check(report, gpus=ranks)["cgroup limits"].verdict == SKIP, "an older probe: not looked, not passed"


def test_the_probe_reads_its_own_cgroup():
    report = run_probe()
    assert report["cgroup"]["version"] in (1, 2) and "error" not in report["cgroup"]
    for what in ("memory", "cpu", "pids"):
        if what in report["cgroup"]:
            assert Path(report["cgroup"][what]["file"]).is_file()


def test_a_driver_upgraded_without_a_reboot_gets_the_cure_for_that():
    report = healthy_report()
    report["gpus"] = {"available": False, "count": 0, "devices": [],
                      "reason": "NVML: RM has detected an NVML/RM version mismatch."}
    found = by_check(report)["gpus"]
    assert found.verdict == FAIL and "version mismatch" in found.detail
    assert "reboot" in found.hint and "modprobe nvidia" in found.hint and "install" not in found.hint
    report["gpus"]["reason"] = "NVML: Driver Not Loaded"
    assert "modprobe nvidia" in by_check(report)["gpus"].hint


def test_what_differs_names_the_odd_node_and_the_versions_on_each_side():
    reports = {f"node{i}": {"packages": {"transformers": "5.24.0", "peft": "0.21.2"}} for i in range(3)}
    reports["node1"]["packages"]["transformers"] = "4.57.1"
    found = cluster.check_packages(reports)
    assert found.verdict == WARN
    assert "transformers 4.57.1 on node1; 5.24.0 on node0, node2" in found.detail
    big = {f"gpu{i:02d}": {"packages": {"transformers": "5.24.0"}} for i in range(32)}
    big["gpu07"]["packages"]["transformers"] = "4.57.1"
    assert "transformers 4.57.1 on gpu07; 5.24.0 on the other 31" in cluster.check_packages(big).detail
    env = {"node0": {"env": {}}, "node1": {"env": {"NCCL_IB_DISABLE": "1"}}}
    drift = cluster.check_distributed_env(env)
    assert drift.verdict == WARN and "NCCL_IB_DISABLE: 1 on node1; unset on node0" in drift.detail


def test_one_lost_gpu_fails_by_name_and_the_others_are_still_checked():
    report = healthy_report()
    report["gpus"]["devices"][3] = {"index": 3, "error": "NVMLError_GpuIsLost: GPU is lost"}
    report["gpus"]["devices"][5]["temperature_c"] = 95
    results = by_check(report)
    assert results["gpus"].verdict == FAIL
    assert "1 of 8 GPU(s) could not be read (GPU3: NVMLError_GpuIsLost" in results["gpus"].detail
    assert "Xid 79" in results["gpus"].hint
    assert results["thermal"].verdict in (WARN, FAIL) and "GPU5" in results["thermal"].detail
    assert results["ecc"].verdict == PASS and results["persistence"].verdict == PASS


def test_the_probe_keeps_the_gpus_it_can_read():
    """probe.py's NVML reading: a GPU whose query raises is reported with its error, beside the others."""
    sys.path.insert(0, str(REPO / "launchers"))
    try:
        import probe
    finally:
        sys.path.pop(0)

    class Lost(Exception):
        pass

    class FakeNVML:
        def nvmlInit(self):
            pass

        def nvmlShutdown(self):
            pass

        def nvmlDeviceGetCount(self):
            return 2

        def nvmlSystemGetDriverVersion(self):
            return "580.1"

        def nvmlSystemGetCudaDriverVersion(self):
            return 13000

    good = {"index": 0, "name": "NVIDIA H200"}
    real = probe._gpu
    probe._gpu = lambda nvml, index: copy.deepcopy(good) if index == 0 else (_ for _ in ()).throw(Lost("GPU is lost"))
    before = sys.modules.get("pynvml")
    sys.modules["pynvml"] = FakeNVML()
    try:
        found = probe.probe_gpus()
    finally:
        probe._gpu = real
        if before is None:
            del sys.modules["pynvml"]
        else:
            sys.modules["pynvml"] = before
    assert found["available"] and found["devices"][0] == good
    assert found["devices"][1] == {"index": 1, "error": "Lost: GPU is lost"}


def test_ecc_that_nvml_cannot_count_is_no_pass():
    report = healthy_report()
    for device in report["gpus"]["devices"]:
        for key in ("ecc_volatile_uncorrected", "retired_pages_pending", "remapped_rows_pending",
                    "remapped_rows_failed"):
            device[key] = None
    found = by_check(report)["ecc"]
    assert found.verdict == SKIP and "no ECC" in found.detail
