"""Preflight remembers (issue 53): each measured figure against the same part's own past, on saved entries."""
from __future__ import annotations

import json

from nodectl.preflight.history import Figure, History, figures_of, judge_history, judge_stragglers
from nodectl.preflight.verdict import FAIL, WARN

REPORTS = {"node0": {"gpus": {"driver": "550.54.15", "devices": [{"index": 0, "uuid": "GPU-aaaa0000"},
                                                                {"index": 1, "uuid": "GPU-bbbb1111"}]},
                     "torch": {"version": "2.6.0", "nccl": "2.21.5"}},
           "node1": {"gpus": {"devices": [{"index": 0, "uuid": "GPU-cccc2222"}]}}}


def jobs(gemm: float = 700.0, slow: float | None = None) -> dict:
    return {"node0": {"devices": [{"index": 0, "gemm_tflops": gemm, "hbm_gbps": 4000.0},
                                  {"index": 1, "gemm_tflops": slow or gemm, "hbm_gbps": 4000.0}]},
            "node1": {"devices": [{"index": 0, "gemm_tflops": gemm, "hbm_gbps": 4000.0}]}}


COLLECTIVE = {"backend": "nccl", "sizes": [{"bytes": 1 << 20, "busbw_gbs": 20.0}, {"bytes": 1 << 30, "busbw_gbs": 360.0}],
              "pairs": [{"nodes": ["node1", "node0"], "busbw_gbs": 45.0}]}


def past(history: History, count: int = 5, gemm: float = 700.0, start: float = 1_790_000_000.0) -> None:
    for i in range(count):
        history.add(figures_of(REPORTS, jobs(gemm), COLLECTIVE), {}, ["node0", "node1"], when=start + i * 86400)


def test_a_gpu_slower_than_its_own_past_is_named_with_both_figures(tmp_path):
    history = History(tmp_path)
    past(history)
    today = figures_of(REPORTS, jobs(slow=590.0), COLLECTIVE)   # GPU 1 of node0 lost 16%
    drift = judge_history(today, history.entries())
    (found,) = drift.results
    assert found.verdict == WARN and found.node == "node0", found
    assert "node0 GPU 1 (GPU-bbbb1111)" in found.detail and "bf16 GEMM 590.0 TFLOP/s" in found.detail
    assert "16% below its own median of 700.0 over 5 earlier preflight(s)" in found.detail, found.detail
    assert "last measured well" in found.detail and "--history node0" in found.hint
    assert "1 of" in drift.summary
    assert judge_history(figures_of(REPORTS, jobs(slow=500.0), COLLECTIVE), history.entries()).results[0].verdict == FAIL
    strict = judge_history(today, history.entries(), warn=0.05, fail=0.15)   # the thresholds are the caller's
    assert strict.results[0].verdict == FAIL


def test_a_healthy_rerun_raises_nothing_and_says_it_matches_its_history(tmp_path):
    history = History(tmp_path)
    past(history)
    drift = judge_history(figures_of(REPORTS, jobs(gemm=690.0), COLLECTIVE), history.entries())
    assert drift.results == ()
    assert drift.summary.startswith("history: matches its own past (8 figure(s) within 10%"), drift.summary


def test_a_pair_and_the_all_reduce_are_judged_and_cpu_figures_from_their_third_past_on(tmp_path):
    history = History(tmp_path)
    past(history)
    slow_pair = dict(COLLECTIVE, pairs=[{"nodes": ["node0", "node1"], "busbw_gbs": 30.0}])
    (found,) = judge_history(figures_of(REPORTS, jobs(), slow_pair), history.entries()).results
    assert found.node == "cluster" and "pair node0+node1: busbw 30.0 GB/s, 33% below" in found.detail
    gloo = {"backend": "gloo", "sizes": [{"bytes": 64 << 20, "busbw_gbs": 1.0}]}
    cpu = figures_of({"a": {}, "b": {}}, {}, gloo)
    history.add(cpu, {}, ["a", "b"])
    fallen = figures_of({"a": {}, "b": {}}, {}, dict(gloo, sizes=[{"bytes": 64 << 20, "busbw_gbs": 1 / 22}]))
    drift = judge_history(fallen, history.entries())   # one CPU figure in its past: too noisy to judge yet
    assert drift.results == () and "without enough past to judge" in drift.summary
    history.add(figures_of({"a": {}, "b": {}}, {}, dict(gloo, sizes=[{"bytes": 64 << 20, "busbw_gbs": 1.3}])), {},
                ["a", "b"])
    history.add(figures_of({"a": {}, "b": {}}, {}, dict(gloo, sizes=[{"bytes": 64 << 20, "busbw_gbs": 0.8}])), {},
                ["a", "b"])
    (found,) = judge_history(fallen, history.entries()).results   # a 22x fall, judged with the wider band
    assert found.verdict == FAIL and "95% below its own median of 1.0" in found.detail, found
    assert "a CPU figure: judged with a wider band" in found.detail
    halved = figures_of({"a": {}, "b": {}}, {}, dict(gloo, sizes=[{"bytes": 64 << 20, "busbw_gbs": 0.45}]))
    assert [r.verdict for r in judge_history(halved, history.entries()).results] == [WARN]
    jitter = figures_of({"a": {}, "b": {}}, {}, dict(gloo, sizes=[{"bytes": 64 << 20, "busbw_gbs": 0.6}]))
    assert judge_history(jitter, history.entries()).results == ()   # 40% down: CPU noise, not judged a fall


def test_a_preflight_that_takes_far_longer_than_its_own_past_warns(tmp_path):
    history = History(tmp_path)
    for seconds in (40.0, 52.0, 45.0):
        history.add([Figure("preflight:default:a+b", "seconds", seconds, "cluster", "the default preflight of a+b",
                            judged=False)], {}, ["a", "b"])
    slow = [Figure("preflight:default:a+b", "seconds", 45.0 * 5.3, "cluster", "the default preflight of a+b",
                   judged=False)]
    (found,) = judge_history(slow, history.entries()).results
    assert found.verdict == WARN and "the default preflight of a+b took 238 s, 5.3x its own median of 45 s" \
        in found.detail, found
    usual = [Figure("preflight:default:a+b", "seconds", 100.0, "cluster", "the default preflight of a+b",
                    judged=False)]
    assert judge_history(usual, history.entries()).results == ()
    assert [r["label"] for r in history.rows("a")] == ["the default preflight of a+b"] * 3


def test_the_history_is_bounded_private_and_survives_a_damaged_line(tmp_path):
    history = History(tmp_path)
    past(history, count=2)
    with history.path.open("a") as handle:
        handle.write("{not json\n")
    past(history, count=1)
    assert len(history.entries()) == 3 and (history.path.stat().st_mode & 0o777) == 0o600
    rows = history.rows("node1")
    assert {r["label"] for r in rows} == {"node1 GPU 0 (GPU-cccc2222)", "pair node0+node1",
                                          "all-reduce of 1024 MiB over node0+node1"}
    assert json.loads(history.path.read_text().splitlines()[0])["figures"][0]["key"] == "gpu:GPU-aaaa0000"


def test_a_node_that_held_back_two_recent_runs_is_warned_of_and_the_figures_are_untouched(tmp_path):
    history = History(tmp_path)
    past(history, count=3)
    now = 1_790_000_000.0 + 20 * 86400
    verdict = {"node": "node1", "rank": 3, "gpu": "1", "slower": 0.69, "pace": 0.59,
               "causes": ["another process on GPU 1 (pid 3694, user bob, python3)"]}
    history.add_straggler("run-a", verdict, when=now - 30 * 86400)   # too old to count
    history.add_straggler("run-b", verdict, when=now - 3 * 86400)
    assert judge_stragglers(["node0", "node1"], history.entries(), now=now) == []   # one recent run: not yet
    history.add_straggler("run-c", {**verdict, "node": "node9"}, when=now - 2 * 86400)   # not in this inventory
    history.add_straggler("run-d", verdict, when=now - 86400)
    results = judge_stragglers(["node0", "node1"], history.entries(), now=now)
    assert [(r.node, r.verdict) for r in results] == [("node1", WARN)]
    assert "node1 held back 2 runs in the last 14 days" in results[0].detail
    assert "run run-d: rank 3, 69% slower; another process on GPU 1 (pid 3694, user bob, python3)" in results[0].detail
    # the straggler lines are no figures: the drift judge and --history's rows see the same as before
    assert len(history.rows()) == 3 * len(figures_of(REPORTS, jobs(), COLLECTIVE))
    assert judge_history(figures_of(REPORTS, jobs(), COLLECTIVE), history.entries()).results == ()


def test_a_gpu_uuid_claimed_by_two_nodes_is_named_and_judges_neither(tmp_path):
    """Round four: the history keyed a GPU by the UUID its node reports. A compromised node2 claimed node1's GPU
    with inflated figures; node1's honest figures then fell 'below its own past' and failed. Now a GPU is judged
    only against what its own node measured, and a UUID two nodes claim is named and judges neither."""
    history = History(tmp_path)
    past(history)
    forged = {**REPORTS, "node2": {"gpus": {"devices": [{"index": 0, "uuid": "GPU-cccc2222"}]}}}
    for i in range(5):   # node2 claims node1's GPU at 2x its rate, five times
        history.add(figures_of(forged, {"node2": {"devices": [{"index": 0, "gemm_tflops": 1400.0,
                                                              "hbm_gbps": 8000.0}]}}, None),
                    {}, ["node2"], when=1_790_500_000.0 + i)
    drift = judge_history(figures_of(REPORTS, jobs(), COLLECTIVE), history.entries())
    assert not [r for r in drift.results if r.node == "node1"], drift.results
    (conflict,) = [r for r in drift.results if "GPU-cccc2222" in r.detail]
    assert conflict.verdict == WARN and "node1, node2" in conflict.detail and "judges neither" in conflict.detail
    # node0's GPUs are still judged against their own past
    slowed = judge_history(figures_of(REPORTS, jobs(slow=500.0), COLLECTIVE), history.entries())
    assert any(r.node == "node0" and r.verdict == FAIL for r in slowed.results)


def keyed(job_set: dict, keys: dict) -> dict:
    """The GPU jobs as preflight's run.py hands them on: each with the host key its connection verified."""
    return {node: {**job, "host_key": keys[node]} for node, job in job_set.items()}


def test_a_gpu_is_judged_only_against_what_the_same_node_by_its_host_key_measured(tmp_path):
    """Round four: the history keys a part by the node that measured it, its name and its SSH host key (what the
    controller verified, not what the node says), as well as the GPU's UUID. A machine put in node1's name (another
    host key) with slower GPUs claiming the same UUID starts a new past instead of failing node1's; node1 itself
    is judged against its own."""
    history = History(tmp_path)
    honest = {"node0": "ssh-ed25519 SHA256:n0", "node1": "ssh-ed25519 SHA256:n1"}
    for i in range(5):
        history.add(figures_of(REPORTS, keyed(jobs(), honest), None), {}, ["node0", "node1"], when=1_790_000_000 + i)
    kept = [f for e in history.entries() for f in e["figures"] if f["key"] == "gpu:GPU-cccc2222"]
    assert kept and {f["host"] for f in kept} == {"ssh-ed25519 SHA256:n1"}

    impostor = dict(honest, node1="ssh-ed25519 SHA256:other")
    drift = judge_history(figures_of(REPORTS, keyed(jobs(gemm=300.0), impostor), None), history.entries())
    assert not [r for r in drift.results if r.node == "node1"], drift.results   # no past of its own: not judged
    drift = judge_history(figures_of(REPORTS, keyed(jobs(gemm=300.0), honest), None), history.entries())
    assert {r.node for r in drift.results if r.verdict == FAIL} == {"node0", "node1"}, drift.results
    # entries kept before host keys were recorded still judge the node of the same name
    legacy = History(tmp_path / "legacy")
    past(legacy)
    drift = judge_history(figures_of(REPORTS, keyed(jobs(gemm=300.0), honest), None), legacy.entries())
    assert {r.node for r in drift.results if r.verdict == FAIL} == {"node0", "node1"}, drift.results


def test_failures_and_stragglers_are_the_nodes_events_beside_its_figures(tmp_path):
    """`preflight --history NODE` shows everything kept for the node (issue 70): its figures (rows) and what runs
    saw there (events), a failure's description bounded."""
    history = History(tmp_path)
    past(history, count=1)
    history.add_straggler("run-a", {"node": "node1", "rank": 3, "slower": 0.4, "causes": []}, when=1_790_000_100.0)
    history.add_failure("run-b", {"node": "node1", "kind": "exit", "rank": 2, "code": 7,
                                  "description": "rank 2 on node node1 failed (exit code 7)" + "x" * 5000},
                        when=1_790_000_200.0)
    history.add_failure("run-c", {"node": "node0", "kind": "lost", "rank": None, "code": None,
                                  "description": "node node0 was lost"}, when=1_790_000_300.0)
    events = history.events("node1")
    assert [(e["event"], e["run"], e["rank"]) for e in events] == [("straggler", "run-a", 3), ("failure", "run-b", 2)]
    assert events[1]["code"] == 7 and len(events[1]["description"]) == 400
    assert [e["run"] for e in history.events()] == ["run-a", "run-b", "run-c"]
    assert len(history.rows()) == len(figures_of(REPORTS, jobs(), COLLECTIVE))   # no figure among them


def test_held_clocks_are_a_failure_on_the_gpu_whose_gemm_fell_below_its_own_past(tmp_path):
    """Application clocks set to 1,005 of 1,980 MHz: a warning at rest (check_clocks); once the GPU's measured GEMM
    fell below its own past, the clocks keep runs slow: a failure on that GPU's node, and on no other GPU's."""
    from nodectl.preflight.gpu import held_clocks_that_slow
    from nodectl.probe_report import ProbeReport

    history = History(tmp_path)
    past(history)
    held = {"sm_clock_app_mhz": 1005, "sm_clock_max_mhz": 1980, "clock_events": ["applications clocks setting"]}
    reports = json.loads(json.dumps(REPORTS))
    reports["node0"]["gpus"]["devices"][1].update(held)   # GPU 1 of node0, the one whose GEMM falls
    reports["node1"]["gpus"]["devices"][0].update(held)   # held too, its GEMM as before: a warning still
    typed = {node: ProbeReport.of(r) for node, r in reports.items()}
    drift = judge_history(figures_of(reports, jobs(slow=520.0), COLLECTIVE), history.entries())
    assert ("gpu:GPU-bbbb1111", "gemm_tflops") in drift.fallen and len(drift.fallen) == 1, drift.fallen
    (failed,) = held_clocks_that_slow(typed, drift.fallen)
    assert (failed.check, failed.node, failed.verdict) == ("clocks", "node0", FAIL), failed
    assert "GPU1 applications clocks 1005 of 1980 MHz" in failed.detail and "nvidia-smi -rac" in failed.hint
    steady = judge_history(figures_of(reports, jobs(), COLLECTIVE), history.entries())
    assert held_clocks_that_slow(typed, steady.fallen) == []   # at rest, held: check_clocks's warning alone
