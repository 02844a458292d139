"""The goodput ledger (issue 67): a run's wall time split into productive time and each kind of lost time, from
its timeline, its pace windows and rank 0's heartbeats; the kinds add up to the wall clock."""
from __future__ import annotations

import json

import pytest

from nodectl.goodput import KINDS, Timeline, beats_of, ledger

pytestmark = pytest.mark.quick


def _line(time, what, attempt=0, **facts):
    return {"time": time, "what": what, "attempt": attempt, **facts}


def test_every_second_of_a_restarted_run_lands_in_one_kind_and_they_add_up_to_the_wall_clock():
    entries = [_line(0, "launch"), _line(10, "started"), _line(25, "first step", step=1),
               _line(25, "beat", step=1), _line(65, "beat", step=31, checkpoint_s=5.0, eval_s=2.0, data_s=3.0),
               _line(60, "failed"), _line(62, "noticed"),
               _line(63, "continuing", 1, checkpoint=30, reached=36),
               _line(70, "started", 1), _line(80, "first step", 1, step=31),
               _line(100, "beat", 1, step=51, checkpoint_s=1.0)]
    spent = ledger(entries, now=500, ended=100, pace_windows=[{"time": 85, "pace": 1.0}, {"time": 95, "pace": 0.5}])
    lost = spent.lost
    assert spent.wall == 100
    assert lost["set-up"] == 10                       # launch to the first attempt's start
    assert lost["start-up"] == 15                     # attempt 0: start to first step
    assert (lost["checkpoints"], lost["evaluation"], lost["data waits"]) == (6.0, 2.0, 3.0)
    assert lost["failures"] == 2                      # failed at 60, noticed at 62
    assert lost["restarts"] == 8 + 10                 # noticed to attempt 1's start, and attempt 1's start-up
    assert lost["work redone"] == pytest.approx(6.0)  # steps 30-36 again, at attempt 0's 1 s a step
    assert lost["slow-downs"] == pytest.approx(5.0)   # 10 s at pace 0.5
    assert spent.productive + sum(lost.values()) == pytest.approx(spent.wall)
    assert set(lost) == set(KINDS)
    assert spent.line(live=False).startswith("goodput 33%; lost 1m07s: restarts 18s, start-up 15s, set-up 10s, ")
    assert [a["attempt"] for a in spent.attempts] == [0, 1] and spent.attempts[1]["continued_from"] == 30
    assert json.loads(json.dumps(spent.to_json()))["goodput"] == pytest.approx(0.33)


def test_what_cannot_be_seen_is_named_and_bad_records_count_as_nothing(tmp_path):
    # a plain script that marks no phase and writes no heartbeat: its start-up runs to the end, said so
    spent = ledger([_line(0, "launch"), _line(4, "started")], now=20)
    assert spent.lost["set-up"] == 4 and spent.lost["start-up"] == 16 and spent.productive == 0
    assert any("first step" in u for u in spent.unseen) and any("phase" in u for u in spent.unseen)
    assert "(not seen: " in spent.line(live=True) and "so far" in spent.line(live=True)
    # a phase mark that is not a number of seconds >= 0 counts as nothing
    spent = ledger([_line(0, "launch"), _line(1, "started"), _line(2, "first step", step=1),
                    _line(9, "beat", step=8, checkpoint_s=-5, eval_s="x", data_s=float("nan"))], now=10)
    assert spent.lost["checkpoints"] == spent.lost["evaluation"] == spent.lost["data waits"] == 0
    # a run recorded before the ledger existed: no ledger, never an error
    assert ledger([_line(3, "started")], now=10) is None
    timeline = Timeline(tmp_path)
    timeline.add("launch", 0, when=1.0)
    with open(timeline.path, "a") as out:
        out.write("{not json\n" + json.dumps({"time": "soon", "what": "started", "attempt": 0}) + "\n"
                  + json.dumps({"time": 2.0, "what": "started", "attempt": True}) + "\n")
    timeline.add("started", 0, when=3.0)
    assert [(e["what"], e["time"]) for e in timeline.entries()] == [("launch", 1.0), ("started", 3.0)]
    assert beats_of([_line(5, "beat", step=2), _line(6, "beat", step=3)]) == {0: _line(6, "beat", step=3)}


def test_overlapping_views_never_add_up_to_more_than_the_clock():
    entries = [_line(0, "launch"), _line(0, "started"), _line(1, "first step", step=1),
               _line(10, "beat", step=10, checkpoint_s=8.0, data_s=8.0)]
    spent = ledger(entries, now=10, pace_windows=[{"time": 2, "pace": 0.1}, {"time": 10, "pace": 0.1}])
    assert sum(spent.lost.values()) == pytest.approx(10) and spent.productive == 0
