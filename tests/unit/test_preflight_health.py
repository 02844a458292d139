"""GPU and fabric health checks (issue 16) on crafted reports of 8-GPU H100 nodes: each case has one thing wrong,
and the check must name that GPU, port or node and the fix; the healthy node passes every one."""
from __future__ import annotations

import copy

import pytest

from nodectl.preflight import cluster as cluster_checks, gpu as gpu_checks, judge
from nodectl.preflight.judge import Expectation, NodeFacts
from nodectl.preflight.verdict import FAIL, PASS, SKIP, WARN
from test_preflight_checks import healthy_report



def by_check(report, env=None):
    facts = NodeFacts("n0", report, "cuda", Expectation(None, None, "10.0.1.11"), env=env or {})
    return {r.check: r for r in judge.judge_node(facts, tier="quick")}


def with_gpu(index, **changes):
    report = copy.deepcopy(healthy_report())
    report["gpus"]["devices"][index].update(changes)
    return report


def test_the_healthy_node_passes_every_health_check():
    results = by_check(healthy_report())
    assert {r.verdict for r in results.values()} == {PASS}, {k: r.detail for k, r in results.items()}


@pytest.mark.parametrize("changes, check, verdict, words", [
    ({"pcie_width": 8}, "pcie link", FAIL, "GPU3 x8 of x16"),
    ({"clock_events": ["hw slowdown", "hw thermal slowdown"]}, "thermal", FAIL, "GPU3 hw slowdown, hw thermal"),
    ({"temperature_c": 84}, "thermal", WARN, "GPU3 84 C (slowdown at 87 C)"),
    ({"sm_clock_app_mhz": 1005, "clock_events": ["applications clocks setting"]}, "clocks", WARN,
     "GPU3 applications clocks 1005 of 1980 MHz"),
    ({"clock_events": ["gpu idle", "applications clocks setting"]}, "clocks", WARN,
     "GPU3 clocks set by the applications clocks setting"),
    ({"mig_mode": 1}, "mig", FAIL, "GPU3 has MIG enabled"),
    ({"mig_pending": 1}, "mig", WARN, "GPU3 has a MIG change pending"),
    ({"compute_mode": 2}, "mig", FAIL, "GPU3 compute mode is prohibited"),
    ({"fabric": {"state": 1, "status": 0}}, "fabric manager", FAIL, "GPU3 not started"),
    ({"nvlinks_active": 16}, "nvlink", FAIL, "GPU3 16 of 18 links active"),
    ({"nvlink_errors": {"crc_flit": 0, "crc_data": 0, "replay": 12, "recovery": 1}}, "nvlink errors", WARN,
     "GPU3 replay 12, recovery 1"),
])
def test_one_bad_gpu_is_named(changes, check, verdict, words):
    result = by_check(with_gpu(3, **changes))[check]
    assert result.verdict == verdict and words in result.detail, result
    assert result.hint
    others = {k: r.verdict for k, r in by_check(with_gpu(3, **changes)).items() if k != check}
    assert set(others.values()) == {PASS}, others


def test_facts_nvml_cannot_give_skip_with_the_reason():
    report = healthy_report()
    for device in report["gpus"]["devices"]:
        for key in ("pcie_width", "pcie_width_max", "temperature_c", "mig_mode", "mig_pending", "compute_mode",
                    "fabric", "nvlink_errors"):
            device[key] = None
        device["clock_events"] = None
        device["sm_clock_app_mhz"] = None
    results = by_check(report)
    for check in ("pcie link", "thermal", "clocks", "mig", "fabric manager"):
        assert results[check].verdict == SKIP, results[check]
    # counters it could not read are no pass (issue 41): a check that could not look says so
    assert results["nvlink errors"].verdict == SKIP and "no NVLink error counters" in results["nvlink errors"].detail
    report["gpus"] = {"error": "NVMLError: Driver Not Loaded"}
    assert all(by_check(report)[c].verdict == SKIP for c in ("pcie link", "thermal", "mig", "fabric manager"))


def test_no_nvswitch_fabric_is_a_skip_not_a_failure():
    report = healthy_report()
    for device in report["gpus"]["devices"]:
        device["fabric"] = {"state": 0}   # NVML: not supported (PCIe or NVLink-bridge systems)
    assert by_check(report)["fabric manager"].verdict == SKIP


def test_xid_events_from_the_kernel_log():
    report = healthy_report()
    report["kernel_events"] = {"readable": True, "events": [
        {"kind": "xid", "pci": "0000:48:00", "code": 13, "text": "NVRM: Xid (PCI:0000:48:00): 13, Graphics Exception"},
        {"kind": "xid", "pci": "0000:48:00", "code": 79, "text": "NVRM: Xid (PCI:0000:48:00): 79, GPU has fallen off "
                                                                  "the bus."}]}
    result = by_check(report)["xid"]
    assert result.verdict == FAIL and "Xid 79 (GPU fell off the bus) on GPU3" in result.detail, result
    assert "nvidia-smi -r" in result.hint
    report["kernel_events"]["events"] = report["kernel_events"]["events"][:1]
    result = by_check(report)["xid"]
    assert result.verdict == WARN and "Xid 13 on GPU3" in result.detail, result
    report["kernel_events"] = {"readable": False, "reason": "/dev/kmsg: Operation not permitted; dmesg: "
                                                             "read kernel buffer failed: Operation not permitted"}
    result = by_check(report)["xid"]
    # Ubuntu's dmesg_restrict=1 for a non-root login: a fallen GPU would show only there, so not looking warns
    assert result.verdict == WARN and "dmesg_restrict" in result.hint and "were not checked" in result.detail


def test_the_probe_reads_xid_and_sxid_lines():
    from support import probe_script

    probe = probe_script.load()
    events = probe.parse_xids([
        "[ 8123.4] NVRM: Xid (PCI:0000:1b:00): 79, pid=1234, name=python, GPU has fallen off the bus.",
        "[ 9000.0] nvidia-nvswitch3: SXid (PCI:0000:07:00.0): 12028, Non-fatal, Link 44 egress non-posted PRIV",
        "[ 9001.0] usb 1-1: new device"])
    assert [(e["kind"], e["code"], e["pci"]) for e in events] == [("xid", 79, "0000:1b:00"),
                                                                  ("sxid", 12028, "0000:07:00.0")]
    assert probe.clock_events(0x1 | 0x4 | 0x40) == ["gpu idle", "sw power cap", "hw thermal slowdown"]
    assert probe.clock_events(0x2 | 0x200 | 0x400) == ["applications clocks setting", "board limit", "reliability"]
    # --quick reads torch's CUDA from its version.py as text (as the CUDA and CPU wheels write it)
    assert probe.torch_cuda_of("__version__ = '2.6.0+cu124'\ncuda: Optional[str] = '12.4'\n") == "12.4"
    assert probe.torch_cuda_of("cuda = '13.0'\nhip = None\n") == "13.0"
    assert probe.torch_cuda_of("cuda: Optional[str] = None\n") is None
    assert probe.probe_torch_metadata()["imported"] is False   # this machine's torch, never imported


def test_ib_port_errors_peermem_and_numa():
    report = healthy_report()
    report["infiniband"][5]["ports"][0]["counters"] = {"symbol_error": 4012, "link_downed": 2, "port_rcv_errors": 0}
    result = by_check(report)["ib errors"]
    assert result.verdict == WARN and "mlx5_5/1 symbol_error 4012, link_downed 2" in result.detail

    report = healthy_report()
    report["modules"]["nvidia_peermem"] = False
    result = by_check(report)["gpudirect"]
    assert result.verdict == WARN and "modprobe nvidia_peermem" in result.hint

    report = healthy_report()
    for device in report["infiniband"]:
        device["numa_node"] = 0          # every NIC on socket 0: GPUs 4-7 cross the socket link
    result = by_check(report)["numa"]
    assert result.verdict == WARN and "GPU4 (NUMA 1)" in result.detail and "GPU3" not in result.detail


@pytest.mark.parametrize("value, verdict, words", [
    ("mlx5_0,mlx5_1", PASS, ""),
    ("=mlx5_0:1,mlx5_3:1", PASS, ""),
    ("mlx5_9", FAIL, "no mlx5_9 on the node"),
    ("mlx5_0:2", FAIL, "no mlx5_0:2"),
    ("=mlx5", FAIL, "no mlx5 on the node"),          # exact: the prefix alone names nothing
    ("^mlx5", FAIL, "leaves no active port"),
    ("^mlx5_7", PASS, ""),
    ("mlx5_2", FAIL, "mlx5_2 is not ACTIVE"),
])
def test_nccl_ib_hca_must_name_active_ports(value, verdict, words):
    report = healthy_report()
    report["infiniband"][2]["ports"][0]["state"] = "1: DOWN"
    result = by_check(report, {"NCCL_IB_HCA": value})["ib hca"]
    assert result.verdict == verdict and words in result.detail, result
    if verdict == FAIL:
        assert "mlx5_0:1" in result.hint and "mlx5_2:1" not in result.hint


def test_a_downtrained_ib_port_is_named_against_the_fastest():
    reports = {f"n{i}": healthy_report() for i in range(4)}
    reports["n2"]["infiniband"][6]["ports"][0]["rate"] = "200 Gb/sec (4X HDR)"
    result = cluster_checks.check_ib_rates(reports)
    assert result.verdict == WARN and "n2 mlx5_6/1 200 Gb/s" in result.detail and "400" in result.detail
    assert cluster_checks.check_ib_rates({k: v for k, v in reports.items() if k != "n2"}).verdict == PASS


def job(per_gpu=None):
    devices = []
    for i in range(8):
        device = {"index": i, "name": "NVIDIA H100 80GB HBM3", "gemm_tflops": 700.0 + i, "hbm_gbps": 2900.0 - i,
                  "h2d_gbps": 52.0, "d2h_gbps": 50.0, "clock_events": ["sw power cap"], "temperature_c": 61,
                  "pcie_gen": 5, "pcie_width": 16}
        device.update((per_gpu or {}).get(i, {}))
        devices.append(device)
    return {"gpus": 8, "devices": devices, "pairs": []}


def test_gpu_job_names_the_slow_or_throttled_gpu():
    [figures, load] = gpu_checks.check_gpu_perf("n0", job())
    assert figures.verdict == PASS and load.verdict == PASS, (figures, load)

    [figures, _] = gpu_checks.check_gpu_perf("n0", job({5: {"gemm_tflops": 410.0}}))
    assert figures.verdict == FAIL and "GPU5 bf16 GEMM 410 TFLOP/s" in figures.detail
    assert "of the node's other GPUs' median" in figures.detail and "GPU4" not in figures.detail

    [figures, _] = gpu_checks.check_gpu_perf("n0", job({2: {"h2d_gbps": 26.0}}))   # a x8 link: half the bandwidth
    assert figures.verdict == FAIL and "GPU2 host-to-device 26 GB/s, 50%" in figures.detail

    two = job({1: {"gemm_tflops": 560.0}})   # a 2-GPU node, one GPU at 80%: a median of both would hide it
    two["devices"] = two["devices"][:2]
    [figures, _] = gpu_checks.check_gpu_perf("n0", two)
    assert figures.verdict == FAIL and "GPU1 bf16 GEMM 560 TFLOP/s, 80%" in figures.detail, figures

    [_, load] = gpu_checks.check_gpu_perf("n0", job({6: {"clock_events": ["sw power cap", "hw power brake"]}}))
    assert load.verdict == FAIL and "GPU6 throttled under load: hw power brake" in load.detail

    [_, load] = gpu_checks.check_gpu_perf("n0", job({1: {"pcie_gen": 3}}))
    assert load.verdict == WARN and "GPU1 reached PCIe gen 3" in load.detail


def test_a_node_slow_as_a_whole_is_named_against_the_cluster():
    jobs = {f"n{i}": job() for i in range(4)}
    jobs["n3"] = job({i: {"hbm_gbps": 2000.0} for i in range(8)})   # every GPU of one node: power capped?
    medians = gpu_checks.cluster_medians(jobs)
    [figures, _] = gpu_checks.check_gpu_perf("n3", jobs["n3"], medians)
    assert figures.verdict == FAIL and "of the cluster's median" in figures.detail, figures
    assert gpu_checks.check_gpu_perf("n0", jobs["n0"], medians)[0].verdict == PASS


def test_gpu_job_failures_and_absence():
    assert gpu_checks.check_gpu_perf("n0", None)[0].verdict == SKIP
    result = gpu_checks.check_gpu_perf("n0", {"error": "RuntimeError: CUDA error: unknown error"})[0]
    assert result.verdict == FAIL and "CUDA error" in result.detail
    result = gpu_checks.check_gpu_perf("n0", job({4: {"error": "CUDA out of memory"}}))[0]
    assert result.verdict == FAIL and "GPU4: CUDA out of memory" in result.detail


class HeldClocksNVML:
    """NVML of a GPU whose applications clocks someone set to 1,005 of 1,980 MHz (issue 70); any other call
    raises, as a call a driver does not support does."""
    def nvmlDeviceGetApplicationsClock(self, handle, kind):
        return 1005 if kind == 1 else 2619

    def nvmlDeviceGetMaxClockInfo(self, handle, kind):
        return 1980 if kind == 1 else 2619

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return 0x1 | 0x2

    def __getattr__(self, name):
        def unsupported(*args):
            raise RuntimeError(f"{name}: Not Supported")
        return unsupported


def test_the_probe_reads_the_applications_clocks_and_the_check_names_the_held_gpu():
    from support import probe_script

    health = probe_script.load()._gpu_health(HeldClocksNVML(), object(), 0)
    assert (health["sm_clock_app_mhz"], health["sm_clock_max_mhz"]) == (1005, 1980)
    assert health["clock_events"] == ["gpu idle", "applications clocks setting"]
    result = by_check(with_gpu(5, **health))["clocks"]
    assert result.verdict == WARN and "GPU5 applications clocks 1005 of 1980 MHz" in result.detail, result
    assert "nvidia-smi -rac" in result.hint
