"""Every preflight check judged on crafted probe reports, including hardware this machine lacks."""
from __future__ import annotations


import pytest

from nodectl.preflight import cluster as cluster_checks, judge, network as network_checks
from nodectl.preflight.judge import Expectation, NodeFacts
from nodectl.preflight.network import judge_collective, transports_in
from nodectl.preflight.verdict import FAIL, PASS, SKIP, WARN

EXPECT = Expectation(gpus=8, master_port=29500, master_addr="10.0.1.11")


def gpu(index, **over):
    device = {"index": index, "name": "NVIDIA H100 80GB HBM3", "memory_used_bytes": 500 << 20, "vbios": "96.00.99.00.01",
              "persistence_mode": True, "ecc_volatile_uncorrected": 0, "retired_pages_pending": False,
              "remapped_rows_pending": False, "remapped_rows_failed": False, "nvlinks_active": 18, "nvlinks": 18,
              "compute_processes": [], "pci_bus_id": f"00000000:{0x18 + 0x10 * index:02X}:00.0",
              "numa_node": index // 4, "pcie_gen": 5, "pcie_gen_max": 5, "pcie_width": 16, "pcie_width_max": 16,
              "clock_events": ["gpu idle"], "sm_clock_app_mhz": 1980, "sm_clock_max_mhz": 1980, "temperature_c": 34, "slowdown_c": 87, "mig_mode": 0, "mig_pending": 0,
              "compute_mode": 0, "fabric": {"state": 3, "status": 0},
              "nvlink_errors": {"crc_flit": 0, "crc_data": 0, "replay": 0, "recovery": 0}}
    device.update(over)
    return device


def healthy_report():
    return {
        "torch": {"version": "2.6.0+cu124", "imported": True, "cuda": "12.4", "nccl": "2.21.5", "cuda_available": True},
        "python": {"version": "3.11.9", "executable": "/opt/venv/bin/python3"},
        "gpus": {"available": True, "count": 8, "driver": "550.54.15", "devices": [gpu(i) for i in range(8)]},
        "infiniband": [{"name": f"mlx5_{i}", "ports": [{"port": 1, "state": "4: ACTIVE", "phys_state": "5: LinkUp",
                                                       "rate": "400 Gb/sec (4X NDR)", "link_layer": "InfiniBand",
                                                       "counters": {"symbol_error": 0, "link_downed": 0,
                                                                    "port_rcv_errors": 0}}],
                        "fw_ver": "28.39.1002", "driver_version": "24.04-0.6.6", "numa_node": i // 4}
                       for i in range(8)],
        "modules": {"nvidia_peermem": True, "nv_peer_mem": False, "nvidia": True},
        "kernel_events": {"readable": True, "events": []},
        "cgroup": {"version": 2},
        "limits": {"memlock_soft": "unlimited", "nofile_soft": 1048576, "nofile_hard": 1048576,
                   "nproc_soft": 2061564, "nproc_hard": 2061564, "pids_max": "max"},
        "nics": [{"name": "lo", "state": "unknown"}, {"name": "ens1", "state": "up"}, {"name": "ens2", "state": "down"},
                 {"name": "ib0", "state": "up"}],
        "disk": {"shm_bytes": 64 << 30, "free_bytes": 500 << 30, "workdir": "/home/u/nodectl", "writable": True,
                 "scratch": {"tmp": {"path": "/tmp", "writable": True, "free_bytes": 200 << 30},
                             "cache": {"path": "/home/u/.cache", "writable": True, "free_bytes": 500 << 30}}},
        "clock": {"skew_s": 0.02, "round_trip_s": 0.3},
        "os": {"kernel": "5.15.0-119-generic", "hostname": "gpu01", "hostname_resolves": ["10.0.0.11"],
               "hosts_line": {"line": 3, "text": "10.0.0.11 gpu01"}},
        "cpu": {"governor": "performance"},
        "memory": {"swap_total_bytes": 0, "overcommit_memory": 0, "overcommit_ratio": 50,
                   "commit_limit_bytes": 1 << 40, "committed_bytes": 20 << 30},
        "packages": {"torch": "2.6.0", "peft": "0.13.0"},
    }


def verdicts(report, extras=None, device="cuda", env=None):
    return {r.check: r for r in judge.judge_node(NodeFacts("n0", report, device, EXPECT, extras or {}, env or {}))}


def test_healthy_8_gpu_ib_node_passes():
    p2p = {"gpus": 8, "pairs": [{"src": s, "dst": d, "ok": True, "peer_access": True, "gbps": 380.0}
                                for s in range(8) for d in range(8) if s != d],
           "devices": [{"index": i, "name": "NVIDIA H100 80GB HBM3", "gemm_tflops": 700.0, "hbm_gbps": 2900.0,
                        "h2d_gbps": 52.0, "d2h_gbps": 50.0, "clock_events": [], "pcie_gen": 5} for i in range(8)]}
    results = verdicts(healthy_report(), {"p2p": p2p, "port": {"port": 29500, "free": True, "asked": 29500},
                                          "reach": {"ok": True, "ms": 1.0}, "route": {"dev": "ens1"}})
    assert {r.verdict for r in results.values()} == {PASS}, {k: r.detail for k, r in results.items()
                                                              if r.verdict != PASS}
    assert results["interface"].env == {"NCCL_SOCKET_IFNAME": "ens1", "GLOO_SOCKET_IFNAME": "ens1"}


def test_p2p_that_returns_wrong_data_fails_with_the_env_fix():
    p2p = {"gpus": 2, "pairs": [{"src": 0, "dst": 1, "ok": False, "peer_access": True, "gbps": 20.0},
                                {"src": 1, "dst": 0, "ok": True, "peer_access": True, "gbps": 20.0}]}
    result = verdicts(healthy_report(), {"p2p": p2p})["p2p"]
    assert result.verdict == FAIL and "0->1: wrong data" in result.detail
    assert result.env == {"NCCL_P2P_DISABLE": "1"} and "ACS" in result.hint
    error = verdicts(healthy_report(), {"p2p": {"error": "RuntimeError: CUDA error: invalid argument"}})["p2p"]
    assert error.verdict == FAIL and "invalid argument" in error.detail


def test_ib_port_down_and_low_memlock_fail():
    report = healthy_report()
    report["infiniband"][3]["ports"][0].update(state="1: DOWN", phys_state="3: Disabled")
    report["limits"]["memlock_soft"] = 65536
    results = verdicts(report)
    assert results["infiniband"].verdict == FAIL and "mlx5_3/1 1: DOWN" in results["infiniband"].detail
    assert results["memlock"].verdict == FAIL and "limits.conf" in results["memlock"].hint


def test_foreign_process_ecc_and_persistence():
    report = healthy_report()
    report["gpus"]["devices"][2] = gpu(2, compute_processes=[{"pid": 4242, "user": "bob"}], memory_used_bytes=70 << 30)
    report["gpus"]["devices"][5] = gpu(5, ecc_volatile_uncorrected=3, persistence_mode=False)
    results = verdicts(report)
    assert results["gpu idle"].verdict == FAIL and "pid 4242 (bob)" in results["gpu idle"].detail
    assert results["ecc"].verdict == FAIL and "GPU5: 3 uncorrectable" in results["ecc"].detail
    assert results["persistence"].verdict == WARN and "nvidia-smi -pm 1" in results["persistence"].hint


def test_too_few_gpus_mixed_models_nvlink_gap():
    report = healthy_report()
    report["gpus"]["count"] = 4
    report["gpus"]["devices"] = [gpu(i) for i in range(3)] + [gpu(3, name="NVIDIA A100", nvlinks_active=0)]
    results = verdicts(report)
    assert results["gpus"].verdict == FAIL and "4 GPU(s), 8 asked by --gpus" in results["gpus"].detail
    assert results["nvlink"].verdict == FAIL and "GPU3 0 of 18 links active" in results["nvlink"].detail


def test_small_shm_disk_and_clock_skew():
    report = healthy_report()
    report["disk"].update(shm_bytes=64 << 20, free_bytes=1 << 30)
    report["clock"] = {"skew_s": 45.0, "round_trip_s": 0.2}
    results = verdicts(report)
    assert results["shm"].verdict == FAIL and "--shm-size" in results["shm"].hint
    assert results["shm"].detail == "/dev/shm is 64.0 MiB", results["shm"].detail   # not "0.1 GiB"
    assert results["disk"].verdict == FAIL
    assert results["clock"].verdict == FAIL
    report["clock"] = {"skew_s": 2.0, "round_trip_s": 0.2}
    assert verdicts(report)["clock"].verdict == WARN


def test_missing_torch_and_cpu_nodes_skip_gpu_checks():
    report = healthy_report()
    report["torch"] = {"error": "ModuleNotFoundError: No module named 'torch'"}
    results = verdicts(report, device="cpu")
    assert results["torch"].verdict == FAIL and "-m pip install torch" in results["torch"].hint
    assert "gpus" not in results and "p2p" not in results


def test_cross_node_versions_fail_and_packages_warn():
    a, b = healthy_report(), healthy_report()
    b["torch"]["nccl"] = "2.20.3"
    b["packages"]["peft"] = "0.11.0"
    results = {r.check: r for r in judge.judge_cluster({"n0": a, "n1": b}, {"n0": "cuda", "n1": "cuda"})}
    assert results["same nccl"].verdict == FAIL and "2.20.3 on n1" in results["same nccl"].detail
    assert results["same torch"].verdict == PASS
    assert results["same packages"].verdict == WARN and "peft" in results["same packages"].detail


def test_route_through_docker_bridge_recommends_ifname():
    result = network_checks.check_route("n1", {"dev": "docker0"}, "10.0.1.11")
    assert result.verdict == WARN and "NCCL_SOCKET_IFNAME" in result.env
    assert network_checks.check_route("n1", {"dev": "lo"}, "127.0.0.2").verdict == PASS
    assert network_checks.check_reach_master("n1", {"ok": False, "error": "Connection refused"}, "x:1").verdict == FAIL


LOG = """\
node0:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
node0:1:1 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM/read
node0:1:1 [0] NCCL INFO Channel 00/0 : 7[7] -> 8[0] [send] via NET/Socket/0
node0:1:1 [0] NCCL INFO Channel 00/0 : 8[0] -> 7[7] [receive] via NET/Socket/1
"""


def test_transport_parse_and_ib_socket_fallback_fails():
    transports = transports_in(LOG)
    assert transports == {"P2P/CUMEM/read": 2, "NET/Socket/0": 1, "NET/Socket/1": 1}
    result = {"world": 16, "backend": "nccl", "sizes": [{"bytes": 1 << 30, "ok": True, "busbw_gbs": 3.1}]}
    verdict = {r.check: r for r in judge_collective(result, transports, ib_present=True, nnodes=2, failure=None)}
    assert verdict["nccl transport"].verdict == FAIL and "NCCL_IB_DISABLE" in verdict["nccl transport"].env
    ib = transports_in("... via NET/IB/0/GDRDMA\n... via NET/IB/1/GDRDMA\n")
    verdict = {r.check: r for r in judge_collective(result, ib, ib_present=True, nnodes=2, failure=None)}
    assert verdict["nccl transport"].verdict == PASS and verdict["collective"].verdict == PASS
    staged = transports_in("... via NET/IB/0\n... via NET/IB/1\n")   # IB, but no GPUDirect RDMA
    verdict = {r.check: r for r in judge_collective(result, staged, ib_present=True, nnodes=2, failure=None)}
    assert verdict["nccl transport"].verdict == WARN and "without GPUDirect RDMA" in verdict["nccl transport"].detail
    assert "nvidia_peermem" in verdict["nccl transport"].hint


def test_wrong_sums_fail():
    result = {"world": 4, "backend": "gloo", "sizes": [{"bytes": 1 << 20, "ok": False, "busbw_gbs": 1.0}]}
    assert judge_collective(result, {}, False, 2, None)[0].verdict == FAIL


def test_a_failed_collective_job_names_its_run_for_the_logs():
    failed = judge_collective(None, {}, False, 2, "rank 1 on node n1 failed (exit code 1): Connection refused",
                              run_id="20261122-101010-abcd")[0]
    assert failed.verdict == FAIL and "Connection refused" in failed.detail
    assert "nodectl tail all --run 20261122-101010-abcd" in failed.hint and "--run RUN" not in failed.hint


def test_a_failed_collective_is_named_on_the_node_whose_address_could_not_be_reached_not_on_the_reporter():
    """The issue's case: rank 0 on n0 reports `Connection refused, remote=[127.0.1.1]`; 127.0.1.1 is what n1's
    host name resolves to, so n1 is named, with its /etc/hosts line; an address that is n1's addr: points at n1's
    firewall; an address no node owns leaves the verdict on the cluster."""
    from types import SimpleNamespace

    from nodectl.preflight.network import address_owners
    from nodectl.probe_report import ProbeReport

    healthy, debian = healthy_report(), healthy_report()
    healthy["os"].update(hostname="n0", hostname_resolves=["10.0.0.11"])
    debian["os"].update(hostname="n1", hostname_resolves=["127.0.1.1", "10.0.0.12"],
                        hosts_line={"line": 2, "text": "127.0.1.1 n1"})
    nodes = [SimpleNamespace(name="n0", addr="10.0.0.11"), SimpleNamespace(name="n1", addr="10.0.0.12")]
    owners = address_owners(nodes, {"n0": ProbeReport.of(healthy), "n1": ProbeReport.of(debian)})
    said = ("rank 0 on node n0 failed (exit code 1): RuntimeError: Gloo connectFullMesh failed with [pair.cc:144] "
            "Connection refused, remote=[127.0.1.1]:41234")
    named = judge_collective(None, {}, False, 2, said, "R", owners)
    assert [(r.node, r.verdict) for r in named] == [("n1", FAIL)], named
    assert "127.0.1.1, what n1's host name n1 resolves to (/etc/hosts line 2: '127.0.1.1 n1')" in named[0].detail
    assert "GLOO_SOCKET_IFNAME" in named[0].hint and "on n1, map its host name" in named[0].hint
    walled = judge_collective(None, {}, False, 2, said.replace("127.0.1.1", "10.0.0.12"), "R", owners)
    assert [(r.node, r.verdict) for r in walled] == [("n1", FAIL)] and "firewall" in walled[0].hint, walled
    nobody = judge_collective(None, {}, False, 2, said.replace("127.0.1.1", "10.9.9.9"), "R", owners)
    assert [r.node for r in nobody] == ["cluster"] and "nodectl tail all --run R" in nobody[0].hint


def test_pair_tests_point_at_the_common_slow_node():
    from nodectl.preflight.network import judge_pairs

    pairs = [{"nodes": ["a", "b"], "busbw_gbs": 40.0}, {"nodes": ["b", "c"], "busbw_gbs": 11.0},
             {"nodes": ["c", "d"], "busbw_gbs": 12.0}, {"nodes": ["d", "a"], "busbw_gbs": 41.0}]
    (result,) = judge_pairs(pairs)
    assert result.verdict == WARN and "common node: c" in result.detail
    healthy = [{"nodes": ["a", "b"], "busbw_gbs": 40.0}, {"nodes": ["b", "a"], "busbw_gbs": 39.0}]
    assert judge_pairs(healthy)[0].verdict == PASS


def test_facts_that_could_not_be_read_are_skip_with_the_reason_never_pass():
    report = healthy_report()
    report["gpus"] = {"error": "NVMLError: Unknown Error"}
    report["disk"] = {"error": "PermissionError: /dev/shm"}
    report["limits"] = {"error": "OSError"}
    report["infiniband"] = {"error": "PermissionError: /sys/class/infiniband"}
    results = verdicts(report)
    report["nics"] = {"error": "PermissionError: /sys/class/net"}
    results = verdicts(report, env={"NCCL_SOCKET_IFNAME": "ens1"})
    for check in ("gpu idle", "ecc", "persistence", "nvlink", "memlock", "shm", "disk", "workdir", "infiniband",
                  "nofile", "socket ifname"):
        assert results[check].verdict == SKIP, (check, results[check])
        assert "could not be read" in results[check].detail
    del report["disk"]
    assert "no disk facts" in verdicts(report)["disk"].detail


def test_unwritable_workdir_fails_with_its_path_and_the_fix():
    report = healthy_report()
    report["disk"].update(writable=False, write_error="PermissionError: Permission denied")
    result = verdicts(report)["workdir"]
    assert result.verdict == FAIL and "/home/u/nodectl" in result.detail and "Permission denied" in result.detail
    assert "workdir:" in result.hint


@pytest.mark.parametrize("soft, verdict", [(256, FAIL), (1023, FAIL), (1024, WARN), (65536, PASS),
                                           ("unlimited", PASS)])
def test_open_files_limit_is_judged(soft, verdict):
    report = healthy_report()
    report["limits"].update(nofile_soft=soft, nofile_hard=4096)
    result = verdicts(report)["nofile"]
    assert result.verdict == verdict, result
    if verdict != PASS:
        assert f"limited to {soft} (hard 4096)" in result.detail and "nofile 1048576" in result.hint


@pytest.mark.parametrize("env, verdict, words", [
    ({}, PASS, "not set"),
    ({"NCCL_SOCKET_IFNAME": "ens1", "GLOO_SOCKET_IFNAME": "ens1"}, PASS, "NCCL_SOCKET_IFNAME=ens1"),
    ({"NCCL_SOCKET_IFNAME": "ens"}, PASS, "ens"),                  # a prefix: ens1 is up
    ({"NCCL_SOCKET_IFNAME": "^docker,lo"}, PASS, "^docker,lo"),    # an exclusion list
    ({"NCCL_SOCKET_IFNAME": "eth0"}, FAIL, "NCCL_SOCKET_IFNAME=eth0: no interface eth0 on the node"),
    ({"GLOO_SOCKET_IFNAME": "=ens"}, FAIL, "no interface ens on the node"),  # `=` is an exact name
    ({"GLOO_SOCKET_IFNAME": "ens2"}, FAIL, "GLOO_SOCKET_IFNAME=ens2: ens2 is down"),
    ({"NCCL_SOCKET_IFNAME": "ens2,ib0"}, PASS, "ens2,ib0"),        # one of the list is up
])
def test_socket_ifname_must_name_an_interface_that_is_up(env, verdict, words):
    result = verdicts(healthy_report(), env=env)["socket ifname"]
    assert result.verdict == verdict and words in result.detail, result
    if verdict == FAIL:
        assert result.hint.endswith("ens1, ib0, lo")  # the interfaces that are up, to choose from


def _probe_module():
    from support import probe_script

    return probe_script.load()


@pytest.mark.parametrize("spec, indexes, unresolved", [
    (None, None, None),                          # not set: every GPU, nothing added to the report
    ("0,3", [0, 3], []),
    ("GPU-3f", [3], []),                         # a UUID prefix
    ("1,9,2", [1], ["9", "2"]),                  # CUDA stops at the first entry naming no GPU
    ("", [], []),                                # set but empty: no GPU
    ("0,0", [0], ["0"]),                         # a GPU named twice
])
def test_the_probe_applies_cuda_visible_devices_to_nvmls_list(spec, indexes, unresolved):
    devices = [gpu(i, uuid=f"GPU-{i}f{i}e-0000") for i in range(4)]
    seen = _probe_module().visible_devices(spec, devices)
    if indexes is None:
        assert seen == {}
        return
    assert [d["index"] for d in seen["devices"]] == indexes and seen["count"] == len(indexes)
    assert seen["unresolved"] == unresolved and seen["count_all"] == 4


def test_a_visible_gpu_the_node_lacks_and_gpus_beyond_the_node_fail_with_the_node_and_fix():
    report = healthy_report()
    report["gpus"].update(visible="0,9", count=1, count_all=8, unresolved=["9"], devices=[gpu(0)])
    result = verdicts(report)["gpus"]
    assert result.verdict == FAIL and "CUDA_VISIBLE_DEVICES=0,9 names '9', which is no GPU of this node" in result.detail
    assert "it has 8" in result.detail and "nvidia-smi -L" in result.hint

    report = healthy_report()
    report["gpus"].update(visible="0", count=1, count_all=8, unresolved=[], devices=[gpu(0)])
    asked = {r.check: r for r in judge.judge_node(NodeFacts("n0", report, "cuda", Expectation(None, 29500, "a"), gpus=2))}
    assert asked["gpus"].verdict == FAIL and "1 visible GPU(s), 2 asked by gpus: in hosts.yaml" in asked["gpus"].detail
    fine = {r.check: r for r in judge.judge_node(NodeFacts("n0", report, "cuda", Expectation(None, 29500, "a"), gpus=1))}
    assert fine["gpus"].verdict == PASS


def test_eight_node_cluster_with_one_odd_node_warns_on_each_difference_and_names_it():
    reports = {f"n{i}": healthy_report() for i in range(8)}
    cluster = {r.check: r for r in cluster_checks.check_uniformity(reports)}
    assert {c: r.verdict for c, r in cluster.items()} == {
        "same kernel": PASS, "same vbios": PASS, "same hca firmware": PASS, "same ofed": PASS, "same swap": PASS,
        "cpu governor": PASS}
    odd = reports["n5"]
    odd["os"]["kernel"] = "6.8.0-45-generic"
    odd["gpus"]["devices"][3]["vbios"] = "96.00.74.00.0B"     # one GPU flashed differently
    odd["infiniband"][0]["fw_ver"] = "28.36.1010"
    odd["memory"]["swap_total_bytes"] = 8 << 30
    odd["cpu"]["governor"] = "powersave"
    cluster = {r.check: r for r in cluster_checks.check_uniformity(reports)}
    for check in ("same kernel", "same vbios", "same hca firmware", "same swap", "cpu governor"):
        assert cluster[check].verdict == WARN and cluster[check].detail.count("on n5") == 1, cluster[check]
    assert "6.8.0-45-generic on n5" in cluster["same kernel"].detail
    assert "96.00.74.00.0B,96.00.99.00.01 on n5" in cluster["same vbios"].detail
    assert "on on n5" in cluster["same swap"].detail and "swapoff" in cluster["same swap"].hint
    assert "powersave on n5" in cluster["cpu governor"].detail and "performance" in cluster["cpu governor"].hint
    assert cluster["same ofed"].verdict == PASS


def test_uniformity_facts_no_node_could_read_are_skip():
    bare = {n: {"torch": {}, "python": {"version": "3.11.9"}} for n in ("n0", "n1")}
    cluster = {r.check: r for r in cluster_checks.check_uniformity(bare)}
    assert {r.verdict for r in cluster.values()} == {SKIP}
    assert "cpufreq" in cluster["cpu governor"].detail


def test_the_judge_lists_what_each_tier_checks():
    """--quick judges the probe only; the default tier adds the GPU job and the all-reduce; --full the node pairs.
    A CPU node gets no GPU check at any tier."""
    def names(tier, device="cuda"):
        return {c.name for c in judge.checks_for(tier, device)}

    quick, default, full = names("quick"), names("default"), names("full")
    assert {"torch", "gpus", "nvlink", "xid", "shm", "clock", "one GPU model"} <= quick
    assert default - quick == {"p2p", "gpu perf, gpu load", "collective, nccl transport", "history"}
    assert full - default == {"node pairs"}
    assert not {c.subject for c in judge.checks_for("full", "cpu")} & {"gpu"}
    assert {c.subject for c in judge.checks_for("full")} == {"host", "gpu", "network", "cluster"}


def test_one_reading_of_nccl_name_lists_for_interfaces_and_hcas():
    prefixes = network_checks.parse_name_list("mlx5_0:1,mlx5_1")
    assert prefixes.selects("mlx5_0", 1) and not prefixes.selects("mlx5_0", 2) and prefixes.selects("mlx5_10", 1)
    exact = network_checks.parse_name_list("=eth0")
    assert exact.selects("eth0") and not exact.selects("eth01")
    excluded = network_checks.parse_name_list("^docker,lo")
    assert excluded.selects("ens1") and not excluded.selects("docker0") and not excluded.selects("lo")


def test_the_preflight_table_fits_80_columns_with_a_gpu_nodes_thirty_checks():
    import io

    from rich.console import Console

    from nodectl.preflight.run import PreflightReport
    from nodectl.cli.preflight_table import print_report

    names = ["gpu-node-with-a-long-name-01", "gpu-node-with-a-long-name-02"]
    results = []
    for name in names:
        report = healthy_report()
        report["gpus"]["devices"][3]["temperature_c"] = 84          # one warning
        results += judge.judge_node(NodeFacts(name, report, "cuda", EXPECT), tier="quick")
    assert len({r.check for r in results}) >= 24
    for full, width in ((False, 80), (True, 200)):
        out = io.StringIO()
        print_report(Console(file=out, width=width, force_terminal=False), PreflightReport(names, results),
                     full=full)
        text = out.getvalue()
        assert all(len(line) <= width for line in text.splitlines())
        assert all(name in text for name in names)
    out = io.StringIO()
    print_report(Console(file=out, width=80), PreflightReport(names, results))
    assert "WARN gpu-node-with-a-long-name-01 thermal" in out.getvalue() and "preflight --all" in out.getvalue()


def test_what_a_rank_writes_to_and_is_limited_by_behind_the_programs_back():
    """The node that looks healthy and is not: a temp folder that cannot be written (torch.compile fails at its
    first graph), a full cache disk, a pids cgroup or ulimit -u that the threads of 8 ranks exhaust."""
    report = healthy_report()
    report["disk"]["scratch"]["tmp"] = {"path": "/tmp", "writable": False, "write_error": "PermissionError: denied"}
    report["disk"]["scratch"]["cache"]["free_bytes"] = 1 << 30
    report["limits"]["pids_max"] = 2048
    results = verdicts(report)
    assert results["tmp"].verdict == FAIL and "/tmp cannot be written" in results["tmp"].detail
    assert "TMPDIR" in results["tmp"].hint
    assert results["cache"].verdict == WARN and "1.0 GiB free in /home/u/.cache" in results["cache"].detail
    assert results["processes"].verdict == FAIL and "pids cgroup allows 2048" in results["processes"].detail
    report["limits"].update(pids_max="max", nproc_soft=8192)
    assert verdicts(report)["processes"].verdict == WARN
    assert "ulimit -u allows 8192" in verdicts(report)["processes"].detail
    del report["limits"]["nproc_soft"], report["limits"]["pids_max"]
    assert verdicts(report)["processes"].verdict == SKIP


def test_distributed_env_that_differs_between_login_environments_warns():
    reports = {name: healthy_report() for name in ("n0", "n1", "n2")}
    for name, report in reports.items():
        report["env"] = {"PATH": f"/bin:{name}", "NCCL_IB_HCA": "mlx5"}
    reports["n1"]["env"]["NCCL_SOCKET_IFNAME"] = "eth0"
    result = cluster_checks.check_distributed_env(reports)
    assert result.verdict == WARN
    assert result.detail == "NCCL_SOCKET_IFNAME: eth0 on n1; unset on n0, n2"
    assert "inventory's env:" in result.hint
    del reports["n1"]["env"]["NCCL_SOCKET_IFNAME"]
    same = cluster_checks.check_distributed_env(reports)
    assert same.verdict == PASS and "1 such variable(s), the same everywhere" == same.detail


def test_cpu_nodes_are_not_failed_for_cuda_nccl_or_driver_they_do_not_use():
    """gloo on CPU nodes uses no CUDA, NCCL or driver: a node whose torch is a CUDA build beside one with the CPU
    build is no failure there; on GPU nodes the same spread fails."""
    import copy
    import json
    from pathlib import Path

    cpu = json.loads((Path(__file__).parent.parent / "data" / "probe" / "cpu-node.json").read_text())
    cuda_build = copy.deepcopy(cpu)
    cuda_build["torch"].update(cuda="12.4", nccl="2.21.5")
    reports = {"node0": cpu, "node1": cuda_build}
    on_cpu = {r.check: r.verdict for r in judge.judge_cluster(reports, {"node0": "cpu", "node1": "cpu"})}
    assert not {"same cuda", "same nccl", "same driver"} & set(on_cpu) and on_cpu["same torch"] == PASS
    on_gpu = {r.check: r.verdict for r in judge.judge_cluster(reports, {"node0": "cuda", "node1": "cuda"})}
    assert on_gpu["same cuda"] == FAIL and on_gpu["same nccl"] == FAIL


# --- what a run will hit that preflight did not read before (issue 53) ---------------------------------------

def test_a_file_system_out_of_inodes_is_named_as_such_not_as_disk_space():
    report = healthy_report()
    report["disk"].update(free_inodes=0, total_inodes=65536, mount="/scratch")
    report["disk"]["scratch"]["tmp"].update(writable=False, write_error="OSError: No space left on device",
                                            free_inodes=12, total_inodes=65536, mount="/tmp")
    results = verdicts(report)
    disk, tmp = results["disk"], results["tmp"]
    assert disk.verdict == FAIL and "inodes exhausted on /scratch (df -i)" in disk.detail, disk
    assert "500.0 GiB" in disk.detail and "remove small files on /scratch" in disk.hint, disk
    assert "free space or move workdir" not in (disk.hint or "")
    assert tmp.verdict == FAIL and "inodes exhausted on /tmp" in tmp.detail, tmp
    report["disk"].update(free_inodes=2_000, total_inodes=1_000_000)
    assert verdicts(report)["disk"].verdict == WARN
    report["disk"].update(free_inodes=0, total_inodes=0)   # btrfs counts none: judged by bytes alone
    assert verdicts(report)["disk"].verdict == PASS


@pytest.mark.parametrize("device, verdict", [("cuda", FAIL), ("cpu", WARN)])
def test_strict_memory_overcommit_is_named_with_the_cure(device, verdict):
    report = healthy_report()
    report["memory"].update(overcommit_memory=2, commit_limit_bytes=40 << 30, committed_bytes=39 << 30)
    found = verdicts(report, device=device)["overcommit"]
    assert found.verdict == verdict and "vm.overcommit_memory = 2" in found.detail and "ENOMEM" in found.detail
    assert "sysctl -w vm.overcommit_memory=0" in found.hint and "/etc/sysctl.d/" in found.hint
    report["memory"]["overcommit_memory"] = 1
    assert verdicts(report, device=device)["overcommit"].verdict == PASS


def test_a_host_name_that_resolves_to_loopback_is_a_warning_naming_the_hosts_line():
    report = healthy_report()
    report["os"].update(hostname_resolves=["127.0.1.1"], hosts_line={"line": 2, "text": "127.0.1.1 gpu01"})
    found = {r.check: r for r in judge.judge_node(NodeFacts("n0", report, "cuda", EXPECT, {}, {}, addr="10.0.0.11"))}
    hostname = found["hostname"]
    assert hostname.verdict == WARN and "gpu01 resolves to 127.0.1.1" in hostname.detail, hostname
    assert "/etc/hosts line 2: '127.0.1.1 gpu01'" in hostname.detail and "map gpu01 to 10.0.0.11" in hostname.hint
    on_loopback = {r.check: r for r in judge.judge_node(NodeFacts("n0", report, "cuda", EXPECT, {}, {},
                                                                   addr="127.0.0.2"))}
    assert on_loopback["hostname"].verdict == PASS   # a cluster on one machine's loopback reaches it there


def test_over_several_nodes_a_host_name_gloo_would_bind_to_loopback_fails_a_cpu_node_unless_pinned():
    """gloo binds the first address the host name resolves to (127.0.0.1 when none): over several nodes the others
    connect to their own loopback. A CPU node fails; a GPU node (NCCL picks its own interface) warns."""
    from nodectl.preflight.host import check_hostname
    from nodectl.probe_report import ProbeReport

    report = healthy_report()
    report["os"].update(hostname_resolves=["127.0.1.1", "10.0.0.11"], hosts_line={"line": 2, "text": "127.0.1.1 gpu01"})
    typed = ProbeReport.of(report)
    cpu = check_hostname("n1", typed, "10.0.0.11", "cpu", 2)
    assert cpu.verdict == FAIL and "gloo" in cpu.detail and "reach n1 at 10.0.0.11" in cpu.detail, cpu
    assert "GLOO_SOCKET_IFNAME" in cpu.hint and "map gpu01 to 10.0.0.11" in cpu.hint
    assert check_hostname("n1", typed, "10.0.0.11", "cuda", 2).verdict == WARN
    assert check_hostname("n1", typed, "10.0.0.11", "cpu", 1).verdict == WARN   # one node: its ranks are all there
    assert check_hostname("n1", typed, "10.0.0.11", "cpu", 2, {"GLOO_SOCKET_IFNAME": "eth0"}).verdict == WARN
    report["os"]["hostname_resolves"] = ["10.0.0.11", "127.0.1.1"]   # the node's address first: gloo binds it
    assert check_hostname("n1", ProbeReport.of(report), "10.0.0.11", "cpu", 2).verdict == WARN
    report["os"].update(hostname_resolves={"error": "gaierror: [Errno -2] Name or service not known"}, hosts_line=None)
    unresolved = check_hostname("n1", ProbeReport.of(report), "10.0.0.11", "cpu", 2)
    assert unresolved.verdict == FAIL and "bind 127.0.0.1" in unresolved.detail, unresolved
    assert check_hostname("n1", ProbeReport.of(report), "10.0.0.11", "cpu", 1).verdict == PASS


def test_a_node_whose_ephemeral_port_another_cannot_reach_fails_naming_both_and_the_range():
    from nodectl.preflight.network import check_peer_ports

    refused = {"ok": False, "error": "[Errno 111] Connection refused"}
    answer = {"port": 41234, "range": [32768, 60999], "from": {"n0": refused, "n2": {"ok": True, "ms": 0.3}}}
    found = check_peer_ports("n1", answer)
    assert found.verdict == FAIL and "n0 cannot connect to n1's port 41234" in found.detail, found
    assert "(n2 could)" in found.detail and "Connection refused" in found.detail
    assert "open TCP ports 32768-60999" in found.hint and "--dport 32768:60999" in found.hint
    everyone = check_peer_ports("n1", dict(answer, **{"from": {"n0": refused, "n2": refused}}))
    assert everyone.verdict == FAIL and everyone.detail.startswith("the other nodes cannot connect"), everyone
    assert check_peer_ports("n1", dict(answer, **{"from": {"n0": {"ok": True}}})).verdict == PASS
    assert check_peer_ports("n1", {"port": 1, "from": {}}).verdict == SKIP


def test_a_node_that_resolves_the_masters_name_to_another_address_fails_and_reach_master_says_why():
    from nodectl.preflight.network import check_master_name, check_reach_master

    stale = {"name": "gpu-a", "resolved": ["10.0.0.99"], "line": {"line": 4, "text": "10.0.0.99 gpu-a"},
             "master": "n0", "master_has": ["127.0.0.1", "10.0.0.11"]}
    found = check_master_name("n1", stale)
    assert found.verdict == FAIL and "n1 resolves gpu-a (n0's addr:) to 10.0.0.99" in found.detail, found
    assert "/etc/hosts line 4: '10.0.0.99 gpu-a'" in found.detail and "10.0.0.11" in found.hint
    assert check_master_name("n1", dict(stale, resolved=["10.0.0.11"])).verdict == PASS
    assert check_master_name("n1", dict(stale, resolved={"error": "gaierror"})).verdict == FAIL
    assert check_master_name("n1", dict(stale, master_has=["127.0.0.1"])).verdict == SKIP   # nothing to hold it to
    refused = {"ok": False, "error": "timed out"}
    reach = check_reach_master("n1", refused, "gpu-a:29500", stale)
    assert reach.verdict == FAIL and "resolved on n1 to 10.0.0.99" in reach.detail and "firewall" not in reach.hint
    assert "firewall" in check_reach_master("n1", refused, "gpu-a:29500").hint


def test_a_socket_interface_that_does_not_carry_the_route_to_the_other_nodes_fails():
    route = {"dev": "ens1", "peers": {"10.0.0.12": "ens1", "10.0.0.13": "ens1"}}
    env = {"NCCL_SOCKET_IFNAME": "docker0"}
    report = healthy_report()
    report["nics"].append({"name": "docker0", "state": "up"})
    found = verdicts(report, {"route": route}, env=env)["socket route"]
    assert found.verdict == FAIL, found
    assert "NCCL_SOCKET_IFNAME=docker0, but the route to 10.0.0.12 through ens1" in found.detail
    assert "(ens1)" in found.hint
    assert verdicts(report, {"route": route}, env={"NCCL_SOCKET_IFNAME": "ens"})["socket route"].verdict == PASS
    assert verdicts(report, {"route": route}, env={"NCCL_SOCKET_IFNAME": "^docker"})["socket route"].verdict == PASS
