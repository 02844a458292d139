"""The watch's judge: a busy node is slow, never lost; lost needs certain evidence or a silence far past the node's
own history; a survivor's failure is never named over a lost node; the records cannot take swapped fields."""
from __future__ import annotations

import time
import types

import pytest

from nodectl.inventory import Node
from nodectl.launch.attend import LivenessNotices
from nodectl.remote.answers import ExitRecord, PollAnswer, RankState
from nodectl.remote.liveness import Arrivals, Health, Liveness, judge, judge_all
from nodectl.remote.poller import Answer
from nodectl.transport import Knock, NodeResult
from nodectl.watch import Failure, FailureKind, _cause, _lost_node
from nodectl.runs import RunNode


def node(name: str) -> Node:
    return Node(name=name, host="127.0.0.1", addr="127.0.0.1", index=0)


def history(gaps: list[float], interval: float = 1.0) -> Arrivals:
    arrivals = Arrivals(began=0.0, interval=interval)
    at = 0.0
    arrivals.arrived(at)
    for gap in gaps:
        at += gap
        arrivals.arrived(at)
    return arrivals


def test_the_records_take_keywords_only():
    """Answer(result, at, seq, sent, hung) built positionally gave `sent` the bool and `hung` the start time."""
    result = NodeResult(node("n0"), value=None)
    with pytest.raises(TypeError):
        Answer(result, 1.0, 2, 0.5)   # noqa - the point: positional fields are refused
    with pytest.raises(TypeError):
        Failure(FailureKind.RANK, "n0")   # noqa
    answer = Answer(result=result, at=1.0, seq=2, sent=0.5)
    assert (answer.at, answer.seq, answer.sent) == (1.0, 2, 0.5)


def test_a_busy_node_whose_answers_take_20s_is_slow_never_lost():
    """A node whose lines came every 1 s, then every 20 s while its ranks imported torch: 50 s and 70 s of silence
    (its port answering) are slow with the lag, not lost; the default lost_after is 60 s."""
    arrivals = history([1.0] * 20 + [20.0, 20.0, 20.0])
    arrivals.knock = Knock.OPEN
    last = arrivals.last
    for silent in (3.0, 20.0, 50.0, 70.0, 110.0):
        health = judge(arrivals, last + silent, lost_after=60.0)
        assert health.state != Liveness.LOST, (silent, health)
    assert judge(arrivals, last + 50.0, lost_after=60.0).state == Liveness.SLOW
    assert "50s behind" in judge(arrivals, last + 50.0, lost_after=60.0).detail
    assert judge(arrivals, last + 1.2, lost_after=60.0).state == Liveness.UP


def test_silence_far_past_its_own_history_with_its_port_silent_is_lost():
    arrivals = history([1.0] * 30)
    arrivals.knock = Knock.SILENT
    assert judge(arrivals, arrivals.last + 59.0, lost_after=60.0).state == Liveness.SLOW
    lost = judge(arrivals, arrivals.last + 61.0, lost_after=60.0)
    assert lost.state == Liveness.LOST and not lost.certain
    assert "no word for 61s" in lost.detail and "SSH port does not answer" in lost.detail
    # a node that once went 30 s without a word needs three times that before it is lost
    patient = history([1.0] * 30 + [30.0])
    patient.knock = Knock.SILENT
    assert judge(patient, patient.last + 80.0, lost_after=60.0).state == Liveness.SLOW
    assert judge(patient, patient.last + 91.0, lost_after=60.0).state == Liveness.LOST


def test_a_port_that_answers_gives_a_silent_node_twice_as_long_and_says_its_commands_hang():
    arrivals = history([1.0] * 30)
    arrivals.knock = Knock.OPEN
    assert judge(arrivals, arrivals.last + 100.0, lost_after=60.0).state == Liveness.SLOW
    lost = judge(arrivals, arrivals.last + 121.0, lost_after=60.0)
    assert lost.state == Liveness.LOST and "commands hang" in lost.detail


def test_a_node_behind_a_proxy_that_cannot_be_knocked_on_waits_twice_as_long():
    """Its port cannot be asked (a ProxyCommand): nothing says it is down, so silence alone needs twice as long.
    At 64 loaded loopback nodes one such node was called lost at 72 s of silence (bench/watch/watch.py)."""
    arrivals = history([1.0] * 30 + [16.0])
    arrivals.knock = Knock.UNKNOWN
    assert judge(arrivals, arrivals.last + 72.0, lost_after=60.0).state == Liveness.SLOW
    lost = judge(arrivals, arrivals.last + 121.0, lost_after=60.0)
    assert lost.state == Liveness.LOST and "reached through a proxy" in lost.detail


def test_a_node_silent_with_a_crowd_of_others_waits_twice_as_long_and_a_refusal_still_counts_at_once():
    """Silence shared by a quarter of the nodes (at least two others) is the controller's or its network's, more
    likely than each node's: none of them is lost at the single threshold; a refused one still is, at once."""
    now = 200.0
    nodes = {f"node{i}": history([1.0] * 30) for i in range(8)}
    for arrivals in nodes.values():
        arrivals.knock = Knock.SILENT
    quiet = ["node1", "node2", "node3"]
    for name, arrivals in nodes.items():
        arrivals.last = now - (70.0 if name in quiet else 0.5)
    healths = judge_all(nodes, now, lost_after=60.0)
    assert [healths[n].state for n in quiet] == [Liveness.SLOW] * 3
    assert judge(nodes["node1"], now, lost_after=60.0).state == Liveness.LOST   # alone, it would have been
    nodes["node2"].refused = "its SSH port refused the connection twice"
    healths = judge_all(nodes, now, lost_after=60.0)
    assert healths["node2"].state == Liveness.LOST and healths["node2"].certain
    # a node lost for certain is no part of the crowd: node1 is silent beside node3 alone, and judged alone
    assert healths["node1"].state == Liveness.LOST and "fell silent" not in healths["node1"].detail
    for name in quiet:
        nodes[name].last = now - 125.0
        nodes[name].refused = ""
    late = judge_all(nodes, now, lost_after=60.0)
    assert late["node1"].state == Liveness.LOST and "2 other node(s) fell silent at the same time" in late["node1"].detail


def test_a_refusal_is_certain_and_named_with_its_reason():
    arrivals = history([1.0] * 5)
    arrivals.refused = "its watch stream broke and its SSH port then refused the connection"
    health = judge(arrivals, arrivals.last + 1.5, lost_after=60.0)
    assert health.state == Liveness.LOST and health.certain and "refused" in health.detail
    arrivals.arrived(arrivals.last + 2.0)   # it spoke again: the refusal is forgotten
    assert judge(arrivals, arrivals.last + 0.5, lost_after=60.0).state == Liveness.UP


def rank_failed(name: str, rank: int, ranks: tuple[int, ...]) -> NodeResult:
    states = tuple(RankState(rank=r, exit=ExitRecord(code=1, time=time.time()) if r == rank else None)
                   for r in ranks)
    return NodeResult(node(name), value=PollAnswer(now=time.time(), node_rank=0, alive=1, ranks=states))


UP = Health(state=Liveness.UP, silent=0.5, usual=1.0)


def test_a_survivor_is_never_named_over_a_lost_node():
    """node1 lost (its port refused); ranks on node0 and node2 then failed on their broken connections: the cause
    is node1, the survivors are its evidence; while node1 is only in doubt the verdict waits."""
    latest = {"node0": rank_failed("node0", 0, (0, 1)), "node2": rank_failed("node2", 4, (4, 5))}
    survivor = Failure(kind=FailureKind.RANK, node="node0", rank=0, code=1, time=time.time())
    lost = Health(state=Liveness.LOST, silent=4.0, usual=1.0, certain=True, detail="its SSH port refused")
    verdict = _cause(survivor, latest, {"node0": UP, "node1": lost, "node2": UP}, wait=True)
    assert verdict.kind == FailureKind.LOST and verdict.node == "node1"
    said = verdict.describe()
    assert said.startswith("node node1 was lost: its SSH port refused [certain]")
    assert "rank 0 on node0" in said and "rank 4 on node2" in said and "not the cause" in said
    slow = Health(state=Liveness.SLOW, silent=4.0, usual=1.0, detail="its stream broke, reconnecting")
    assert _cause(survivor, latest, {"node0": UP, "node1": slow, "node2": UP}, wait=True) is None
    assert _cause(survivor, latest, {"node0": UP, "node1": slow, "node2": UP}, wait=False) is survivor
    assert _cause(survivor, latest, {"node0": UP, "node1": UP, "node2": UP}, wait=True) is survivor


def test_of_two_quiet_nodes_the_refused_one_is_lost():
    run_nodes = [RunNode(node=node(n), node_rank=i, ranks=(i,), run_dir="/x") for i, n in enumerate(("a", "b", "c"))]
    quiet = Health(state=Liveness.LOST, silent=70.0, usual=1.0, detail="no word for 70s")
    refused = Health(state=Liveness.LOST, silent=3.0, usual=1.0, certain=True, detail="refused")
    failure = _lost_node(run_nodes, {"a": quiet, "b": refused, "c": UP})
    assert failure.node == "b" and "[certain]" in failure.detail


def test_the_running_figures_are_the_gaps_mean_and_deviation():
    import random
    import statistics

    rng = random.Random(3)
    gaps = [rng.uniform(0.5, 3.0) for _ in range(450)]   # more than the history keeps: the oldest leave the sums
    arrivals = history(gaps)
    kept = gaps[-len(arrivals.gaps):]
    mean, deviation = arrivals.usual()
    assert mean == pytest.approx(statistics.fmean(kept), rel=1e-9)
    assert deviation == pytest.approx(max(statistics.pstdev(kept), mean / 4), rel=1e-6)


def test_a_flapping_node_is_told_once_per_quiet_window_with_how_often_it_was_late():
    told, now = [], [0.0]
    notices = LivenessNotices(told.append, quiet=300, clock=lambda: now[0])
    slow = Health(state=Liveness.SLOW, silent=6, usual=1, detail="6s behind (it usually sends every 1.0s)")
    up = Health(state=Liveness.UP, silent=0, usual=1)

    def tick(*changes):
        for name, health in changes:
            notices(name, health)
        notices.flush()

    for second in range(0, 280, 20):   # late every 20 s for 280 s: 14 times
        now[0] = float(second)
        tick(("node3", slow))
        tick(("node3", up))
    assert [(e.nodes, e.state) for e in told] == [(("node3",), "slow"), (("node3",), "up")]
    tick(("node5", slow))              # another node is told at once, whatever node3 did
    assert told[-1].nodes == ("node5",) and told[-1].state == "slow"
    now[0] = 301.0                     # past the window: told again, with the count of the ones not told
    tick(("node3", slow))
    assert told[-1].nodes == ("node3",) and "late 13 more time(s) since it was last shown, 5 min ago" in told[-1].details[0]
    tick(("node3", up))
    assert told[-1].state == "up" and len(told) == 5


def test_nodes_that_turn_slow_in_one_tick_are_one_notice_and_the_cli_says_it_in_one_line():
    """64 starved nodes were 62 'is slow' lines and as many 'on time again' (bench/watch/watch.py at 64 nodes)."""
    import io

    from rich.console import Console

    from nodectl.cli.launch import _liveness

    told = []
    notices = LivenessNotices(told.append)
    for i in range(10):
        notices(f"node{i}", Health(state=Liveness.SLOW, silent=6 + i, usual=1, detail=f"{6 + i}s behind"))
    notices.flush()
    notices.flush()                    # nothing new: nothing told
    assert len(told) == 1 and len(told[0].nodes) == 10 and told[0].details[3] == "9s behind"
    out = io.StringIO()
    app = types.SimpleNamespace(err=Console(file=out, width=400))
    _liveness(app, told[0])
    line = out.getvalue().strip()
    assert line.count("\n") == 0 and line.startswith("10 nodes are slow: node0: 6s behind") and "and 6 more" in line
    for i in range(10):
        notices(f"node{i}", Health(state=Liveness.UP, silent=0, usual=1))
    notices.flush()
    _liveness(app, told[-1])
    assert "nodes node0, node1, node2, node3 and 6 more answer on time again" in out.getvalue()


def test_a_restart_says_where_it_continues_from_and_what_is_done_again():
    from nodectl.cli.launch import continuing_line
    from nodectl.launch.events import Continuing

    kept = continuing_line(Continuing(run_id="r", attempt=1, checkpoint=690, reached=712, builtin=True))
    assert kept == ("attempt 1 continues from step 690, the newest checkpoint every node of it holds (the last "
                    "attempt reached step 712); 22 step(s) are done again")
    none = continuing_line(Continuing(run_id="r", attempt=2, checkpoint=None, reached=40, builtin=True))
    assert none.startswith("attempt 2 starts from step 0: no checkpoint") and "train.checkpoint_every" in none
    script = continuing_line(Continuing(run_id="r", attempt=1, checkpoint=None, reached=1180, builtin=False))
    assert "runs the script again from its start" in script and "reached step 1,180" in script, script
