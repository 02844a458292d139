"""The stall watch behind `launch --stall-after`: one hang is told once for the run, not once per rank that falls
silent (each told stall starts a diagnosis of every rank; four of the same hang, one after the other, are noise and
crowd the listeners a user's own `nodectl diagnose` asks)."""
from __future__ import annotations

import time

import pytest

from nodectl.remote.answers import PollAnswer, RankState
from nodectl.transport import NodeResult
from nodectl.watch import StallWatch


def answers(ranks: dict[int, dict]) -> dict[str, NodeResult]:
    """Two nodes of two ranks; each rank's state as given (log size and, for the built-in trainer, a heartbeat)."""
    nodes = {}
    for node in range(2):
        states = tuple(RankState(rank=r, alive=True, **ranks[r]) for r in (2 * node, 2 * node + 1))
        nodes[f"node{node}"] = NodeResult(None, value=PollAnswer(now=time.time(), node_rank=node, alive=2,
                                                                 ranks=states, started=True))
    return nodes


def test_a_script_without_heartbeats_that_hangs_is_told_once_until_a_rank_moves(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    watch = StallWatch(stall_after=10)
    sizes = {0: 120, 1: 118, 2: 118, 3: 90}
    told = []
    for second in range(60):   # every rank silent from the first poll: each passes 10 s, one after the other
        clock[0] = 1000.0 + second
        failure = watch.check(answers({r: {"log_size": s} for r, s in sizes.items()}))
        if failure:
            told.append((second, failure.rank))
    assert told == [(11, 0)], told

    # rank 3 writes a line while the others stay silent: the run moved and is still stalled, told once more (by a
    # rank not told yet), and then not again while nothing moves
    sizes[3] = 95
    for second in range(60, 90):
        clock[0] = 1000.0 + second
        failure = watch.check(answers({r: {"log_size": s} for r, s in sizes.items()}))
        if failure:
            told.append((second, failure.rank, failure.detail))
    assert [t[:2] for t in told[1:]] == [(60, 1)], told
    assert told[1][2] == "no heartbeat (the script writes none) and no output for 60s"


def test_the_built_in_trainer_stalled_at_a_step_is_told_once(monkeypatch):
    watch = StallWatch(stall_after=30)
    hung = {r: {"log_size": 500, "heartbeat": {"step": 7}, "heartbeat_age": age} for r, age in
            ((0, 31.0), (1, 32.0), (2, 33.0), (3, 34.0))}
    first = watch.check(answers(hung))
    assert first is not None and first.rank == 0 and "no heartbeat for 31s (last step 7)" in first.detail
    for _ in range(5):
        assert watch.check(answers(hung)) is None

    # the run goes on (step 8 everywhere) and hangs again: told again
    moved = {r: {**state, "heartbeat": {"step": 8}} for r, state in hung.items()}
    again = watch.check(answers(moved))
    assert again is not None and "(last step 8)" in again.detail


@pytest.mark.parametrize("stall_after", [None, 0])
def test_no_limit_tells_nothing(stall_after):
    watch = StallWatch(stall_after=stall_after)
    assert watch.check(answers({r: {"log_size": 10, "heartbeat": {"step": 1}, "heartbeat_age": 1e6}
                                for r in range(4)})) is None


def test_a_rank_that_logs_on_does_not_retell_another_ranks_stall(monkeypatch):
    """A script whose rank 0 keeps printing (a progress thread) while rank 3 hangs: rank 3's stall is one."""
    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    watch = StallWatch(stall_after=5)
    told = []
    for second in range(40):
        clock[0] = float(second)
        sizes = {0: 100 + second, 1: 100 + second, 2: 100 + second, 3: 64}
        failure = watch.check(answers({r: {"log_size": s} for r, s in sizes.items()}))
        if failure:
            told.append(failure.rank)
    assert told == [3]
