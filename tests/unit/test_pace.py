"""The pace verdict (nodectl/pace.py) on simulated synchronous training: ranks that compute, meet at an all-reduce
and go on together. Each rank reaches collective k when its compute after collective k-1 ends; the others wait for
the last. What the watch is given is what the nodes' polls carry: the arrival times on each node's clock (and, for
NCCL, each collective's duration)."""
from __future__ import annotations

import random
from dataclasses import replace
import re

import pytest

from nodectl.pace import PaceSettings, PaceWatch, Straggler, earlier_stragglers, pace_lines, rank_split
from nodectl.remote.answers import PaceSample, PollAnswer, RankPace, RankState

NODES = {0: "node0", 1: "node0", 2: "node1", 3: "node1"}


def simulate(compute, seconds: float, skew=None, comm: float = 0.01, jitter: float = 0.003, durations=False,
             steps_per_beat: int = 0, settings=PaceSettings(), seed: int = 0, data=None, moved=None,
             comm_of=None, nodes=NODES, forge=None, throttled=None, queued=None, others=None, gpus_of=None,
             rank_gpus=None, pressure=None):
    """Run `seconds` of training where `compute(rank, t)` is a rank's compute time per step at time t; feed the
    watch a poll per node per second; return (watch, [(t, change)]). With `data(rank, t)`, that much of each step
    is the rank getting its batch, told in its heartbeat's data_s as the built-in trainer tells it. A node in
    `forge` has its ranks say they reached each collective that many seconds before they did (their clock as it
    is); with `throttled(rank, t)`, the share of wall time runctl read of the rank's CPU quota holding it back;
    with `queued(rank, t)`, the share it waited on its run queue for a CPU, and `others(node, t)`, the busiest
    processes not the run's that runctl tells of the node; with `gpus_of(node, t)`, the GPU detail runctl gives
    where the watch asks for it (`rank_gpus`: each rank's GPU on its node); with `pressure(node, t)`, the node's
    pressure counters as runctl reads them (mem_some_s, io_some_s, swap_pages)."""
    NODES = nodes  # noqa: N806 (the simulation's ranks and nodes)
    forge = forge or {}
    rng = random.Random(seed)
    skew = skew or {}
    watch = PaceWatch(NODES, rank_gpus, settings=settings, gpus=durations)
    t, seq, pending, changes = 0.0, 0, {n: [] for n in set(NODES.values())}, []
    next_poll = 1.0
    held = dict.fromkeys(NODES, 0.0)
    waited = dict.fromkeys(NODES, 0.0)
    ends = dict.fromkeys(NODES, 0.0)
    fed = dict.fromkeys(NODES, 0.0)
    while t < seconds:
        arrivals = {r: ends[r] + compute(r, t) + (data(r, t) if data else 0.0) + rng.uniform(0, jitter) for r in NODES}
        comm = comm_of(t) if comm_of else comm   # how long the collective itself takes once all are there
        for r in NODES:
            fed[r] += data(r, t) if data else 0.0
        last = max(arrivals.values())
        seq += 1
        for r, at in arrivals.items():
            took = (last - at + comm) * 1e3 if durations else None
            pending[NODES[r]].append((r, seq, at, took))
            ends[r] = last + comm
        t = last + comm
        while t >= next_poll:
            for r in NODES:
                held[r] += throttled(r, next_poll) if throttled else 0.0
                waited[r] += queued(r, next_poll) if queued else 0.0
            for node, entries in pending.items():
                ranks = {}
                for r in (r for r, n in NODES.items() if n == node):
                    mine = [e for e in entries if e[0] == r]
                    ranks[str(r)] = RankPace(groups=tuple("0" for _ in mine), seqs=tuple(e[1] for e in mine),
                                             reached=tuple(int((e[2] + skew.get(node, 0.0) - forge.get(node, 0.0)) * 1e9)
                                                           for e in mine),
                                             durations=tuple(e[3] for e in mine),
                                             moved=tuple(moved[0] for _ in mine) if moved else (),
                                             kinds=tuple(moved[1] for _ in mine) if moved else (),
                                             cpu_s=next_poll, runqueue_s=waited[r],
                                             throttled_s=held[r] if throttled else None)
                step = seq // steps_per_beat if steps_per_beat else None
                answer = PollAnswer(now=next_poll + skew.get(node, 0.0), node_rank=0, alive=2,
                                    ranks=tuple(RankState(r, heartbeat=_beat(step, fed[r] if data else None))
                                                for r in NODES if NODES[r] == node),
                                    pace=PaceSample(ranks=ranks, cpu={
                                        "cpus": 2, "load1": 1.0,
                                        **({"others": others(node, next_poll)} if others else {}),
                                        **(pressure(node, next_poll) if pressure else {})}
                                        if others or pressure else {},
                                        gpus=gpus_of(node, next_poll) if gpus_of and watch.request(
                                            node, [r for r, n in NODES.items() if n == node])[1] else {}))
                watch.feed(node, answer, received=next_poll + 0.004, sent=next_poll - 0.004)
                entries.clear()
            changes += [(next_poll, c) for c in watch.judge(now=next_poll)]
            next_poll += 1.0
    return watch, changes


def _beat(step, data_s):
    beat = {key: value for key, value in (("step", step), ("data_s", data_s)) if value is not None}
    return beat or None


def found(changes):
    return [(t, c) for t, c in changes if isinstance(c, Straggler) and c.ended is None]


def test_a_healthy_run_gets_no_verdict_and_keeps_pace_one():
    watch, changes = simulate(lambda r, t: 0.1, 300)
    assert changes == []
    assert watch.state.pace == pytest.approx(1.0, abs=0.05)
    assert max(t.busy for t in watch.state.ranks) - min(t.busy for t in watch.state.ranks) < 0.1


def test_a_rank_half_as_fast_is_named_within_60s_with_the_pace_it_costs_and_gone_when_it_recovers():
    slow = lambda r, t: 0.2 if r == 3 and 100 <= t < 220 else 0.1  # noqa: E731
    watch, changes = simulate(slow, 320)
    named = found(changes)
    assert len(named) == 1
    at, straggler = named[0]
    assert straggler.rank == 3 and straggler.node == "node1"
    assert at - 100 < 60
    assert straggler.slower >= 0.5          # 2x the compute, with the collective's own time in both
    assert straggler.pace == pytest.approx(0.55, abs=0.08)   # 0.11 s steps became 0.21 s
    gone = [(t, c) for t, c in changes if isinstance(c, Straggler) and c.ended is not None]
    assert gone and gone[0][0] > 220 and watch.state.straggler is None
    assert "rank 3 on node node1 is" in straggler.describe() and "pace 0.5" in straggler.describe()


def test_a_slight_or_brief_slowdown_is_not_a_straggler():
    slight = lambda r, t: 0.11 if r == 3 else 0.1  # noqa: E731   # 10% slower: under the 15% line
    brief = lambda r, t: 0.3 if r == 2 and 100 <= t < 104 else 0.1  # noqa: E731   # 4 s: under the hold
    for compute in (slight, brief):
        _, changes = simulate(compute, 200)
        assert found(changes) == []


def test_every_rank_slower_is_a_run_wide_line_not_a_straggler():
    _, changes = simulate(lambda r, t: 0.3 if t >= 120 else 0.1, 260)
    assert found(changes) == []
    lines = [c for _, c in changes if isinstance(c, str)]
    assert lines and "every rank is slower: pace 0.3" in lines[0] and "no single rank to blame" in lines[0]


def test_the_heartbeat_steps_give_the_pace_in_steps():
    watch, _ = simulate(lambda r, t: 0.1, 120, steps_per_beat=4)
    assert watch.state.unit == "steps/s"
    assert watch.state.rate == pytest.approx(1 / 0.11 / 4, rel=0.1)


def test_a_node_clock_proven_off_is_corrected_one_within_the_poll_is_not():
    # node1's clock 2 s ahead: beyond what the poll's 8 ms can hide, so it is taken off; 3 ms is left alone
    for skew in (2.0, 0.003):
        _, changes = simulate(lambda r, t: 0.2 if r == 1 and t >= 100 else 0.1, 220, skew={"node1": skew})
        named = found(changes)
        assert [c.rank for _, c in named] == [1], (skew, named)


def test_nccl_durations_need_no_clock_at_all():
    # node1's clock 40 ms off, inside nothing the poll proves: arrivals alone would blame node1; durations do not
    slow = lambda r, t: 0.2 if r == 0 and t >= 100 else 0.1  # noqa: E731
    _, changes = simulate(slow, 220, skew={"node1": 0.0}, durations=True)
    assert [c.rank for _, c in found(changes)] == [0]


def test_a_hostile_or_old_record_reads_as_nothing():
    for record in (None, [], "x", {"events": "no"}, {"events": [{"rank": "3"}, 7, None]},
                   {"straggler": {"rank": True, "node": 3}, "ranks": [{"rank": 1, "busy": "a"}]}):
        assert earlier_stragglers(record) == []
        pace_lines(record)
        assert rank_split(record) == {}
    lines = pace_lines({"events": [{"rank": 2, "node": "n1", "slower": 0.4, "since": 10, "ended": 70,
                                    "causes": ["its cgroup's CPU quota held it back 50% of the time", 5]}]},
                       live=False)
    assert lines == ["had a straggler for 60s: rank 2 on node n1, 40% slower (its cgroup's CPU quota held it back "
                     "50% of the time)"]


def test_a_rank_starved_of_data_is_named_with_that_cause_and_the_split_says_where_the_time_goes():
    # every rank computes 0.1 s a step and gets its batch in 0.01 s; from t=60 rank 2's batches take 0.1 s
    data = lambda r, t: 0.1 if r == 2 and t >= 60 else 0.01  # noqa: E731
    watch, changes = simulate(lambda r, t: 0.1, 160, data=data, steps_per_beat=1)
    named = found(changes)
    assert [c.rank for _, c in named] == [2]
    assert any(re.match(r"it waits for its data 4[4-9]% of the time \(the other ranks [3-6]%\)", cause)
               for cause in named[0][1].causes), named[0][1].causes
    shares = {t.rank: t.data for t in watch.state.ranks}
    assert shares[2] == pytest.approx(0.47, abs=0.05) and shares[0] == pytest.approx(0.05, abs=0.02)
    # the median rank: computes ~48%, gets data ~5%, waits ~47% for rank 2 at the all-reduce
    split = watch.state.split
    assert split.startswith("where the time goes (median rank): ") and "% getting data" in split, split
    figures = dict((words, int(number)) for number, words in
                   (part.split("% ", 1) for part in split.split(": ", 1)[1].split(", ")))
    assert figures["waiting for other ranks in collectives"] == pytest.approx(47, abs=5), split
    assert figures["getting data"] == pytest.approx(5, abs=2), split
    record = watch.state.to_json()
    assert rank_split(record)[2][2] == pytest.approx(0.47, abs=0.05)
    assert split in pace_lines(record) and "where the time went (last window)" in pace_lines(record, live=False)[-2]


def test_a_script_without_data_timings_has_no_data_share():
    watch, _ = simulate(lambda r, t: 0.1, 80)
    assert all(t.data is None for t in watch.state.ranks)
    assert "getting data" not in watch.state.split and "% waiting for other ranks" in watch.state.split


def test_nccl_timed_collectives_give_their_bus_bandwidth_against_preflights(tmp_path):
    from nodectl.preflight.history import Figure, History

    history = History(tmp_path)
    history.add([Figure("allreduce:node0+node1:1073741824", "busbw_gbs", 12.0, "cluster", "all-reduce")], {},
                ["node0", "node1"], when=1000.0)
    history.add([Figure("allreduce:node0+node1+node2:1073741824", "busbw_gbs", 99.0, "cluster", "other nodes")],
                {}, ["node0", "node1", "node2"], when=2000.0)
    reference = history.latest_allreduce(["node1", "node0"])
    assert reference == {"busbw_gbs": 12.0, "time": 1000.0, "mib": 1024.0, "curve": []}
    # 64 MiB all-reduces over 4 ranks, each 10 ms once the last rank is there: 64 MiB x 2(n-1)/n / 10 ms
    watch, _ = simulate(lambda r, t: 0.1, 90, durations=True, comm=0.01, moved=(64 << 20, "allreduce"))
    watch.state.reference = reference
    assert watch.state.busbw_gbs == pytest.approx((64 << 20) * 1.5 / 0.01 / 1e9, rel=0.02)
    assert watch.state.collective_mib == 64.0
    split = watch.state.split
    assert "the collectives move 10.1 GB/s (bus bandwidth, median 64 MiB), 84% of the 12.0 GB/s preflight's " \
           "all-reduce of 1024 MiB gave on these nodes: the links give no more" in split, split
    # where preflight kept every size, the run's collectives are set against the nearest one
    history.add([Figure("allreduce:node0+node1:1073741824", "busbw_gbs", 326.0, "cluster", "all-reduce")], {},
                ["node0", "node1"], when=3000.0, curve=[[1 << 20, 3.0], [32 << 20, 20.0], [1 << 30, 326.0]])
    watch.state.reference = history.latest_allreduce(["node0", "node1"])
    assert "50% of the 20.0 GB/s preflight's all-reduce of 32 MiB gave on these nodes" in watch.state.split, \
        watch.state.split
    # small ones measure latency, not links: no figure
    small, _ = simulate(lambda r, t: 0.1, 90, durations=True, comm=0.01, moved=(4096, "allreduce"))
    assert small.state.busbw_gbs is None and "GB/s" not in small.state.split


def test_the_pace_file_counts_bytes_as_nccl_tests_does(monkeypatch):
    from support import REPO

    monkeypatch.syspath_prepend(str(REPO / "launchers"))   # as in a run's lib/
    from flightpace import moved

    assert moved({"profiling_name": "nccl:all_reduce", "input_sizes": [[1000]], "input_dtypes": ["BFloat16"]}) \
        == [2000, "allreduce"]
    assert moved({"profiling_name": "nccl:_allgather_base", "input_sizes": [[1000]], "input_dtypes": ["BFloat16"],
                  "output_sizes": [[2, 1000]], "output_dtypes": ["BFloat16"]}) == [4000, "gather"]   # its output
    assert moved({"profiling_name": "nccl:reduce_scatter_tensor_coalesced", "input_sizes": [[4, 8], [2]],
                  "input_dtypes": ["Float", "Float"]}) == [136, "scatter"]
    assert moved({"profiling_name": "gloo:all_reduce", "input_sizes": [["x"]], "input_dtypes": ["Float"]}) \
        == [None, "allreduce"]


def test_collectives_that_slow_everywhere_name_the_network_in_the_run_wide_line():
    # from t=120 every 64 MiB all-reduce takes 60 ms instead of 10 (a link went bad): every rank waits in it
    slow_link = {"comm": 0.01}

    def compute(rank, t):
        slow_link["comm"] = 0.06 if t >= 120 else 0.01
        return 0.05

    watch, changes = simulate(compute, 260, durations=True, comm=None, moved=(64 << 20, "allreduce"),
                              comm_of=lambda t: slow_link["comm"])
    lines = [c for _, c in changes if isinstance(c, str)]
    assert found(changes) == [] and lines, changes
    assert "every rank is slower" in lines[0] and "the network between the nodes slowed" in lines[0], lines[0]
    assert re.search(r"the collectives move 1\.\d GB/s against 10\.\d GB/s earlier in this run", lines[0]), lines[0]


def test_a_node_speaks_for_its_own_ranks_only_and_a_row_that_is_no_time_is_skipped():
    """A node whose answer carries rows for another node's rank (a forger, or a mix-up) would have those rows judge
    that rank; they are dropped, and so is a row whose time is no time (10^400 ns overflowed and killed the watch)."""
    watch, _ = simulate(lambda r, t: 0.1, 20)
    before = {key: dict(ranks) for key, ranks in watch._reached.items()}
    forged = PollAnswer(now=21.0, node_rank=1, alive=2, ranks=(), pace=PaceSample(ranks={
        "0": RankPace(groups=("0",), seqs=(10 ** 6,), reached=(int(20.5e9),), durations=(None,)),
        "2": RankPace(groups=("0",), seqs=(10 ** 6 + 1,), reached=(10 ** 400,), durations=(None,))}))
    watch.feed("node1", forged, received=21.004, sent=20.996)
    assert {key: dict(ranks) for key, ranks in watch._reached.items()} == before
    watch.judge(now=21.0)


TWO_NODES = {0: "node0", 1: "node1"}


def test_a_node_that_forges_its_ranks_arrivals_gets_no_certain_verdict_a_real_straggler_does():
    """Round four: a rank that says it reached each collective 45 ms early makes the healthy other node's rank
    look slower, and --on-straggler exclude left that node out. The timings are each rank's own word: a verdict
    is certain only when it holds with each other node's timings left out, or its node's counters (runctl's read
    of the CPU quota, run queue, steal, GPU) show a cause."""
    _, changes = simulate(lambda r, t: 0.1, 120, forge={"node0": 0.045})
    named = found(changes)
    assert named and {c.node for _, c in named} == {"node1"}, changes   # the forgery moves the shares...
    verdict = named[0][1]
    assert not verdict.corroborated, verdict   # ...but nothing else agrees
    assert "only node node0's ranks' own timings" in verdict.basis, verdict.basis
    assert "(not certain: " in verdict.describe()

    # a rank truly slower on node1: node1's other rank waits for it too, so node0's word is not needed
    _, changes = simulate(lambda r, t: 0.16 if r == 2 else 0.1, 120)
    (_, verdict), *_ = found(changes)
    assert verdict.rank == 2 and verdict.corroborated, verdict
    assert "not certain" not in verdict.describe()

    # one rank per node: the other node's word alone is never enough...
    _, changes = simulate(lambda r, t: 0.16 if r == 1 else 0.1, 120, nodes=TWO_NODES)
    (_, verdict), *_ = found(changes)
    assert verdict.rank == 1 and not verdict.corroborated, verdict
    # ...but the quota runctl reads on the slow rank's node is
    _, changes = simulate(lambda r, t: 0.16 if r == 1 else 0.1, 120, nodes=TWO_NODES,
                          throttled=lambda r, t: 0.35 if r == 1 else 0.0)
    (_, verdict), *_ = found(changes)
    assert verdict.rank == 1 and verdict.corroborated and "CPU quota" in verdict.basis, verdict


def test_a_record_keeps_whether_a_verdict_was_certain():
    entry = Straggler(rank=1, node="n1", gpu=None, slower=0.7, pace=0.6, since=1.0, corroborated=False,
                      basis="why not").to_json()
    assert earlier_stragglers({"events": [dict(entry, ended=2.0)]})[0].basis == "why not"
    assert not earlier_stragglers({"events": [dict(entry, ended=2.0, corroborated="yes")]})[0].corroborated


def test_exclude_acts_only_on_a_certain_verdict_and_only_that_one_is_remembered(tmp_path, monkeypatch):
    """--on-straggler exclude (nodectl/launch/attend.py StragglerVerdicts) with preflight's real history: an
    uncertain verdict held past the hold is told once as not acted on, the run goes on, and the history blames no
    part; a certain one ends the run and is remembered once."""
    from nodectl.launch.attend import StragglerVerdicts
    from nodectl.launch.events import StragglerHeldBack
    from nodectl.preflight.gate import PreflightGate
    from nodectl.preflight.history import History

    monkeypatch.setenv("NODECTL_STATE_DIR", str(tmp_path))
    told = []
    verdicts = StragglerVerdicts("run-a", PreflightGate(), told.append, exclude_after=15.0)
    forged = Straggler(rank=1, node="node1", gpu=None, slower=0.77, pace=0.6, since=100.0, corroborated=False,
                       basis="only node node0's ranks' own timings say it is slower")
    assert verdicts.take(forged, now=110.0) is None and told == []   # not held long enough yet
    assert verdicts.take(forged, now=116.0) is None
    assert verdicts.take(forged, now=130.0) is None
    assert [type(e) for e in told] == [StragglerHeldBack] and told[0].straggler.basis == forged.basis
    assert [e for e in History(tmp_path).entries() if e.get("straggler")] == []

    real = Straggler(rank=1, node="node1", gpu=None, slower=0.77, pace=0.6, since=200.0, corroborated=True,
                     basis="its node's own counters: its cgroup's CPU quota held it back 35% of the time")
    assert verdicts.take(real, now=205.0) is None
    assert verdicts.take(real, now=216.0) is real
    kept = [e["straggler"] for e in History(tmp_path).entries() if e.get("straggler")]
    assert [(k["run"], k["node"], k["basis"]) for k in kept] == [("run-a", "node1", real.basis)]
    assert len(told) == 1
    # without exclude the certain verdict is remembered as well, and nothing ends the run
    watching = StragglerVerdicts("run-b", PreflightGate(), told.append, exclude_after=None)
    assert watching.take(replace(real, since=300.0), now=900.0) is None
    assert len([e for e in History(tmp_path).entries() if e.get("straggler")]) == 2


def test_a_verdict_is_never_told_below_the_line_and_ends_once_its_rank_stays_under_it():
    """A held verdict was kept while its rank stayed over half the line, told "9% slower" against a 15% line (and,
    under --on-straggler exclude, still acted on). Now it is calm under the line and ends after the hold."""
    compute = lambda r, t: (0.14 if t < 150 else 0.11) if r == 3 and t >= 50 else 0.1  # noqa: E731
    watch, changes = simulate(compute, 330)
    named = found(changes)
    assert [c.rank for _, c in named] == [3], named
    gone = [(t, c) for t, c in changes if isinstance(c, Straggler) and c.ended is not None]
    assert gone and 150 < gone[0][0] < 260, gone   # 10% slower from t=150: calm, then the hold
    assert watch.state.straggler is None
    assert all(c.slower >= PaceSettings().slower for _, c in changes if isinstance(c, Straggler))


def test_status_trusts_the_record_only_for_the_attempt_running_now():
    """Just after a restart the record still holds the last attempt's verdict (rank 0 named, fresh): status showed
    it beside the new attempt's shares, which had rank 0 the less busy. The record speaks for its own attempt."""
    import time

    from nodectl.pace import PaceState, RankTime, current

    record = {"time": time.time(), "attempt": 0, "straggler": {"rank": 0, "node": "node0", "slower": 0.22},
              "ranks": [{"rank": 0, "busy": 0.9, "wait": 0.1}, {"rank": 1, "busy": 0.6, "wait": 0.4}]}
    look = PaceState(ranks=[RankTime(rank=0, node="node0", busy=0.76, wait=0.24),
                            RankTime(rank=1, node="node0", busy=0.87, wait=0.13)])
    told, split = current(record, look, attempt=1)
    assert told is not record and told.get("straggler") is None, told
    assert split[0][0] == 0.76 and split[1][0] == 0.87
    assert current(record, look, attempt=0)[0] is record   # its own attempt's, while fresh
    older = {k: v for k, v in record.items() if k != "attempt"}   # written before records said their attempt
    assert current(older, look, attempt=0)[0] is older and current(older, look, attempt=1)[0] is not older


def test_a_rank_whose_cores_another_process_takes_is_named_with_that_process_and_its_share():
    """A plain script's rank 3 waits on its run queue (a hog shares its cores on node1): the verdict names the
    hog as runctl told it (pid, user, command, its share of a CPU), not only "another process"."""
    slow = lambda r, t: 0.2 if r == 3 and t >= 60 else 0.1  # noqa: E731
    hog = [{"pid": 4446, "user": "bob", "name": "stress\x1b[2J", "share": 0.97}]
    _, changes = simulate(slow, 200, queued=lambda r, t: 0.45 if r == 3 and t >= 60 else 0.0,
                          others=lambda node, t: hog if node == "node1" and t >= 60 else [])
    (at, straggler), = found(changes)
    assert straggler.rank == 3, straggler
    said = "; ".join(straggler.causes)
    assert "waited for a CPU" in said and "on node node1 take its cores: pid 4446 (bob, stress?[2J) 97% of a CPU" \
        in said, said


def test_a_single_status_names_the_cpu_quota_from_the_first_look_runctl_took():
    """A detached run's one `status` polls each node once: with one sample of the rank's counters no rate could be
    made, and a rank its quota held back 35% of the time got "no cause seen on its node". runctl's one-shot poll
    now reads the counters twice (`earlier`, FIRST_LOOK_S before), and the one look names the quota."""
    nodes = {0: "node0", 1: "node1"}
    watch = PaceWatch(nodes)
    now = 1_000.0
    steps = [(now - 40 + i * 0.3, i) for i in range(100)]   # rank 1 reaches each collective 0.2 s after rank 0
    for rank, node in nodes.items():
        late = 0.2 if rank == 1 else 0.0
        earlier = {"ago": 0.3, "cpu_s": 10.0, "runqueue_s": 0.0, "throttled_s": 5.0 if rank == 1 else None}
        pace = RankPace(groups=tuple("0" for _ in steps), seqs=tuple(seq for _, seq in steps),
                        reached=tuple(int((at + late) * 1e9) for at, _ in steps),
                        durations=tuple(None for _ in steps), cpu_s=10.1, runqueue_s=0.0,
                        throttled_s=5.105 if rank == 1 else None, earlier=earlier)
        watch.feed(node, PollAnswer(now=now, node_rank=rank, alive=1, ranks=(RankState(rank),),
                                    pace=PaceSample(ranks={str(rank): pace})), received=now, sent=now - 0.01)
    state = watch.look(now)
    assert state.straggler is not None and state.straggler.rank == 1, state
    assert any("CPU quota held it back 35% of the time" in c for c in state.straggler.causes), state.straggler.causes


def test_straggler_hold_counts_from_the_verdict_told_not_from_when_the_rank_was_first_seen_slower():
    """--straggler-hold 60 acted 47 s after the printed verdict: the hold was counted from when the rank was first
    seen slower, 13 s before it was told. It counts from the verdict now."""
    from nodectl.launch.attend import StragglerVerdicts
    from nodectl.launch.gate import NO_GATE

    verdicts = StragglerVerdicts("run-a", NO_GATE, lambda event: None, exclude_after=60.0)
    seen = Straggler(rank=1, node="node1", gpu=None, slower=0.5, pace=0.7, since=100.0, corroborated=True,
                     basis="its node's own counters", told=113.0)
    assert verdicts.take(seen, now=161.0) is None   # 61 s after first seen, 48 s after told
    assert verdicts.take(seen, now=173.5) is seen
    _, changes = simulate(lambda r, t: 0.2 if r == 3 and t >= 60 else 0.1, 150)
    (at, named), = found(changes)
    assert named.told == at and named.since < named.told, named   # when it was told, after being seen slower


def test_every_rank_slower_names_another_process_on_the_runs_gpus_and_clocks_held_back():
    """One H200, another process sharing the GPU: "every rank is slower ... compute or data on every node take the
    time now", while NVML listed the process. Once the pace falls under the line the watch asks every node for its
    GPUs' detail, and the run-wide line names the process (pid, user, command) and a GPU's clocks held back."""
    from nodectl.remote.answers import GpuDetail

    slow = lambda r, t: 0.2 if t >= 100 else 0.1  # noqa: E731
    burner = GpuDetail(others=({"pid": 3694, "user": "bob", "name": "python3"},))
    capped = GpuDetail(reasons=0x4)
    asked = []

    def gpus_of(node, t):
        asked.append((node, t))
        return {"0": burner if node == "node0" else capped} if t >= 100 else {}

    watch, changes = simulate(slow, 200, durations=True, gpus_of=gpus_of,
                              rank_gpus={r: "0" if r % 2 == 0 else "1" for r in NODES})
    lines = [c for _, c in changes if isinstance(c, str)]
    assert lines and "every rank is slower" in lines[0], changes
    assert "another process on GPU 0 of node0 (pid 3694, user bob, python3)" in lines[0], lines[0]
    assert "GPU 0 of node1's clocks are slowed by its power cap" in lines[0], lines[0]
    assert not [t for _, t in asked if t < 100], asked   # healthy: no node asked for its GPUs


def test_what_a_status_look_sees_of_a_detached_run_is_kept_for_runs_and_never_taken_for_a_launchs_verdict():
    """A detached run has no attached launch to write its pace: `runs` never told the straggler a `status` saw.
    status keeps its look in the record (one event per straggler, from when it was first seen); the next status
    looks again rather than repeating it, and once the run ended `runs` says it had one."""
    import time

    from nodectl.pace import PaceState, RankTime, current, looked_record

    ranks = [RankTime(rank=0, node="node0", busy=0.5, wait=0.5), RankTime(rank=3, node="node1", busy=0.9, wait=0.1)]
    first = PaceState(ranks=ranks, straggler=Straggler(3, "node1", None, 0.8, None, 100.0,
                                                       causes=["its cgroup's CPU quota held it back 35% of the time "
                                                               "(CPU throttling)"]))
    kept = looked_record(None, first, attempt=0)
    assert kept["by"] == "status" and [e["rank"] for e in kept["events"]] == [3]
    later = PaceState(ranks=ranks, straggler=Straggler(3, "node1", None, 0.7, None, 160.0))
    again = looked_record(kept, later, attempt=0)
    assert [(e["rank"], e["since"]) for e in again["events"]] == [(3, 100.0)], again["events"]   # one, from 100
    assert "CPU quota" in again["events"][0]["causes"][0]   # the cause the first look saw stays with it
    assert current(again, later, attempt=0)[0] is not again   # a status's look is not a launch's verdict
    assert looked_record(again, PaceState(ranks=ranks), attempt=0) is None   # nothing seen: nothing written
    ended = dict(again, time=time.time())
    said = pace_lines(ended, live=False)
    assert any(line.startswith("had a straggler") and "rank 3 on node node1" in line for line in said), said


def test_memory_and_io_pressure_are_named_for_a_straggler_and_for_every_rank_slower():
    """Host memory pressure (swapping) and I/O wait were never named: "no cause seen on its node". runctl reads the
    node's pressure stall counters (/proc/pressure) and swapped pages; a node whose tasks stall on I/O 40% of the
    time is the straggler's cause, and memory pressure on every node is in the run-wide line."""
    slow = lambda r, t: 0.2 if r == 3 and t >= 60 else 0.1  # noqa: E731
    io = lambda node, t: {"io_some_s": 0.4 * max(0.0, t - 60) if node == "node1" else 0.0,  # noqa: E731
                          "mem_some_s": 0.01 * t, "swap_pages": 0}
    _, changes = simulate(slow, 200, pressure=io)
    (at, straggler), = found(changes)
    said = "; ".join(straggler.causes)
    assert straggler.rank == 3 and "its node's tasks waited for I/O 40% of the time" in said, said
    assert "memory" not in said, "1% of the time on memory is no cause"

    everyone = lambda r, t: 0.2 if t >= 100 else 0.1  # noqa: E731
    swapping = lambda node, t: {"mem_some_s": 0.3 * max(0.0, t - 100), "io_some_s": 0.0,  # noqa: E731
                                "swap_pages": int(2000 * max(0.0, t - 100))}
    _, changes = simulate(everyone, 200, pressure=swapping)
    lines = [c for _, c in changes if isinstance(c, str)]
    assert lines and "every rank is slower" in lines[0], changes
    assert "on node0 tasks stalled on memory 30% of the time (memory pressure; 2,000 pages swapped per second)" \
        in lines[0], lines[0]
    _, changes = simulate(everyone, 200, pressure=lambda node, t: {"mem_some_s": 0.0, "io_some_s": 0.0})
    assert "stalled" not in "".join(c for _, c in changes if isinstance(c, str))


def test_a_node_that_hides_other_users_processes_says_so_where_it_names_none():
    """A node whose /proc is mounted hidepid=2 shows nodectl's login none of another user's processes: the hog
    that takes rank 3's cores cannot be named, and the verdict says why instead of an unexplained "another
    process"."""
    slow = lambda r, t: 0.2 if r == 3 and t >= 60 else 0.1  # noqa: E731
    _, changes = simulate(slow, 200, queued=lambda r, t: 0.45 if r == 3 and t >= 60 else 0.0,
                          pressure=lambda node, t: {"hidden": "hidepid=2"} if node == "node1" else {})
    (at, straggler), = found(changes)
    said = "; ".join(straggler.causes)
    assert "another process shares its cores" in said and \
        "other users' processes are hidden from nodectl's login on node node1: /proc hidepid=2" in said, said


def test_runctl_reads_that_proc_hides_other_users_processes_from_a_non_root_login():
    """The node side of the above, on this machine's kernel: /proc remounted hidepid=2 in a namespace of its own,
    runctl's CPU sample run as nobody says so; root, who sees every process, is told nothing."""
    import os
    import shutil
    import subprocess
    import sys

    from nodectl.resources import resource_dir

    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"):
        pytest.skip("needs root, unshare and setpriv")
    code = (f"import sys; sys.path.insert(0, {str(resource_dir('launchers'))!r}); from runctl.pace import node_cpu; "
            f"print(node_cpu().get('hidden'))")
    script = ("mount -o remount,hidepid=2 /proc && "
              f"setpriv --reuid=65534 --regid=65534 --clear-groups {sys.executable} -S -c \"$0\" && "
              f"{sys.executable} -S -c \"$0\"")
    done = subprocess.run(["unshare", "--mount", "--pid", "--fork", "--mount-proc", "sh", "-c", script, code],
                          capture_output=True, text=True, timeout=60)
    if done.returncode != 0 and ("Operation not permitted" in done.stderr or "Permission denied" in done.stderr):
        pytest.skip(f"nobody cannot run this interpreter here, or no namespace: {done.stderr.strip()[-200:]}")
    assert done.stdout.split() in (["hidepid=2", "None"], ["hidepid=invisible", "None"]), done.stdout + done.stderr
