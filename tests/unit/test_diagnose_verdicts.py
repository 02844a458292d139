"""Every verdict of `nodectl diagnose` on saved dumps: real node answers of real hung gloo runs (made by
tests/data/diagnose/capture.py from the scenarios next to it, one folder per torch met), a few edited to stand for
what gloo on one CPU machine cannot produce (a node lost, a rank exited while the others wait, every rank stuck in
one collective), and malformed ones, as a broken or hostile node would send."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from nodectl.diagnose.flight import read_recorder
from nodectl.diagnose.gather import view_of
from nodectl.diagnose.verdicts import RankView, judge
from nodectl.remote.answers import AnswerError, parse

DATA = Path(__file__).resolve().parents[1] / "data" / "diagnose"
VERSIONS = sorted(p.name for p in DATA.glob("torch-*") if p.is_dir())


def shorten(path: str) -> str:
    return path.rsplit("/code/", 1)[-1]


def raw(version: str, scenario: str) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((DATA / version / scenario).glob("*.json"))}


def views_of(answers: dict[str, dict]) -> list[RankView]:
    views = []
    for node, document in answers.items():
        if "error" in document:   # a node that did not answer: lost, with its ranks
            views += [RankView(rank, node, running=False, lost=document["error"]) for rank in document["ranks"]]
            continue
        answer = parse("diagnose", document)
        views += [view_of(dump, node, answer.now) for dump in answer.ranks.values()]
    return views


def verdict(version: str, scenario: str):
    return judge(views_of(raw(version, scenario)), shorten)


def test_saved_dumps_exist_for_the_torch_of_this_machine():
    assert "torch-2.13" in VERSIONS
    for version in VERSIONS:
        assert (DATA / version / "torch").read_text().startswith("torch ")


@pytest.mark.parametrize("version", VERSIONS)
def test_rank_behind_is_named_with_node_collective_and_line(version):
    found = verdict(version, "behind")
    assert found.kind == "behind"
    assert found.culprits == (3,)
    assert found.summary.startswith("rank 3 on node1 never entered all_reduce #4 (group 0), which ranks 0-2")
    assert "sleeping at behind.py:14 in `<module>`" in found.summary
    assert "time.sleep(600)" in found.summary


@pytest.mark.parametrize("version", VERSIONS)
def test_the_seed_case_is_stuck_in_compute_at_the_loop(version):
    found = verdict(version, "compute")
    assert found.kind == "compute"
    assert found.culprits == (1,)
    assert found.summary.startswith("rank 1 on node0 is stuck in compute at compute.py:13")
    assert "all_reduce #3 (group 0), which ranks 0, 2-3" in found.summary


@pytest.mark.parametrize("version", VERSIONS)
def test_desync_of_ops_names_both_sides(version):
    found = verdict(version, "desync_op")
    assert found.kind == "desync" and found.culprits == (2,)
    assert "ranks 0-1, 3 called all_reduce with input [4] Float" in found.summary
    assert "rank 2 called broadcast with input [4] Float at desync_op.py:10" in found.summary


@pytest.mark.parametrize("version", VERSIONS)
def test_desync_of_sizes_names_both_shapes(version):
    found = verdict(version, "desync_shape")
    assert found.kind == "desync" and found.culprits == (2,)
    assert "all_gather #2" not in found.summary  # the collective is named by number once, up front
    assert found.summary.startswith("desync in collective #2 (group 0)")
    assert "ranks 0-1, 3 called all_gather with input [4] Float" in found.summary
    assert "rank 2 called all_gather with input [2] Double" in found.summary


@pytest.mark.parametrize("version", VERSIONS)
def test_every_rank_waiting_outside_torch_is_idle(version):
    found = verdict(version, "idle")
    assert found.kind == "idle"
    assert "idle.py:14" in found.summary


@pytest.mark.parametrize("version", VERSIONS)
def test_a_healthy_run_with_long_steps_is_not_a_hang(version):
    found = verdict(version, "healthy")
    assert found.kind == "healthy", found.summary
    assert found.culprits == ()


@pytest.mark.parametrize("version", VERSIONS)
def test_a_lost_node_is_the_verdict_while_the_others_wait(version):
    answers = raw(version, "behind")
    answers["node1"] = {"error": "unreachable for 12s (timed out)", "ranks": [2, 3]}
    found = judge(views_of(answers), shorten)
    assert found.kind == "gone" and found.culprits == (2, 3)
    assert found.summary.startswith("node node1 was lost (unreachable for 12s (timed out)); its ranks 2-3")
    assert "ranks 0-1 wait in all_reduce #4 (group 0)" in found.summary


@pytest.mark.parametrize("version", VERSIONS)
def test_a_rank_that_exited_while_the_others_wait(version):
    answers = raw(version, "behind")
    rank3 = answers["node1"]["ranks"]["3"]
    rank3.update(alive=False, exit={"code": 3, "time": 0.0}, listener=None, cpu=None)
    found = judge(views_of(answers), shorten)
    assert found.kind == "gone" and found.culprits == (3,)
    assert found.summary.startswith("rank 3 on node1 exited with code 3, while ranks 0-2 wait in all_reduce #4")


@pytest.mark.parametrize("version", VERSIONS)
def test_every_rank_in_one_collective_points_at_the_network(version):
    answers = raw(version, "behind")
    waiting = answers["node1"]["ranks"]["2"]["listener"]
    answers["node1"]["ranks"]["3"]["listener"]["flight"] = copy.deepcopy(waiting["flight"])
    found = judge(views_of(answers), shorten)
    assert found.kind == "network"
    assert found.summary.startswith("all 4 ranks of group 0 have been in all_reduce #4 (group 0)")
    assert any("preflight --full" in line for line in found.advice)


@pytest.mark.parametrize("version", VERSIONS)
def test_ranks_waiting_in_a_collective_are_never_called_healthy(version):
    """Rank 3 gave no flight recorder and no CPU figure, so nothing names a cause; ranks 0-2 have waited in
    all_reduce #4 all along. It said "no hang found" against its own evidence."""
    answers = raw(version, "behind")
    answers["node1"]["ranks"]["3"].update(listener=None, cpu=None)
    found = judge(views_of(answers), shorten)
    assert found.kind == "waiting" and "no hang found" not in found.summary, found.summary
    assert found.summary.startswith("ranks 0-2 have waited in all_reduce #4 (group 0) for ")
    assert "(rank 3 gave no flight recorder): not proven hung, not healthy" in found.summary
    assert any("diagnose again" in line for line in found.advice)


def test_a_run_whose_ranks_all_ended_is_not_hung():
    answers = raw("torch-2.13", "behind")
    for document in answers.values():
        for dump in document["ranks"].values():
            dump.update(alive=False, exit={"code": 0, "time": 0.0})
    assert judge(views_of(answers), shorten).kind == "ended"


def test_evidence_has_one_line_per_rank_and_the_verdict_is_data():
    found = verdict("torch-2.13", "behind")
    assert [line.split(":")[0] for line in found.evidence] == \
        ["rank 0 on node0", "rank 1 on node0", "rank 2 on node1", "rank 3 on node1"]
    assert json.loads(json.dumps(found.to_json()))["culprits"] == [3]


HOSTILE = [
    {"threads": "x", "flight": "y"},
    {"threads": [1, {"frames": [[1, 2, 3], ["f.py", "x", "g"]]}], "flight": {"gloo": [1]}},
    {"flight": {"gloo": {"entries": [1, {"collective_seq_id": "a", "profiling_name": 3},
                                     {"collective_seq_id": True, "profiling_name": "gloo:x"}],
                         "pg_status": {"0": "z"}, "pg_config": {"0": {"ranks": "not json"}}}}},
    {"flight": {"nccl": {"error": "RuntimeError: no recorder"}}},
]


@pytest.mark.parametrize("listener", HOSTILE)
def test_malformed_listener_answers_are_skipped_not_a_traceback(listener):
    answers = raw("torch-2.13", "behind")
    for dump in answers["node0"]["ranks"].values():
        dump["listener"] = listener
    found = judge(views_of(answers), shorten)
    assert found.kind in {"behind", "healthy", "compute", "idle"}


def test_a_node_answer_of_the_wrong_shape_is_an_answer_error():
    with pytest.raises(AnswerError, match="`ranks`"):
        parse("diagnose", {"now": 1.0, "node_rank": 0, "ranks": [1, 2]})


def test_older_dump_formats_are_read():
    """torch before 2.4 named the sequence id `seq_id` and had no pg_status; NCCL marks a finished op completed."""
    recorder = read_recorder({"flight": {"nccl": {"version": "1.5", "entries": [
        {"seq_id": 7, "pg_id": 0, "profiling_name": "nccl:all_reduce", "state": "completed",
         "input_sizes": [[8]], "input_dtypes": ["Float"], "time_created_ns": 10**18},
        {"seq_id": 8, "pg_id": 0, "profiling_name": "nccl:all_reduce", "state": "started",
         "input_sizes": [[8]], "input_dtypes": ["Float"], "time_created_ns": 10**18}]}}})
    assert recorder.last_completed == {"0": 7} and recorder.last_enqueued == {"0": 8}
    assert [c.seq for c in recorder.pending()] == [8]
    assert recorder.pending()[0].shapes() == "input [8] Float"


def test_a_real_nccl_dump_reads_its_states_and_points_at_the_gpu():
    """Saved by tests/gpu/test_gpu_node.py on an H200 (torch 2.11, NCCL 2.28.9): one NCCL rank whose 4th all_reduce
    is queued behind a kernel that spins; the recorder calls it scheduled, the first three completed."""
    answers = raw("nccl-2.11", "queued")
    [view] = views_of(answers)
    assert view.recorder.versions == ("nccl 2.10",)
    assert view.recorder.last_completed == {"0": 3} and view.recorder.last_enqueued == {"0": 4}
    [pending] = view.recorder.pending()
    assert (pending.backend, pending.op, pending.seq, pending.state) == ("nccl", "all_reduce", 4, "scheduled")
    assert pending.shapes() == "input [1048576] Float"
    found = judge([view], shorten)
    assert found.kind == "network"
    assert "the only rank of group 0 has been in all_reduce #4 (group 0)" in found.summary
    assert "(nccl: scheduled)" in found.summary


@pytest.mark.parametrize("version", VERSIONS)
def test_a_rank_tearing_down_its_process_group_while_the_others_wait_is_said_so(version):
    """The trainer's old failure path: rank 3 left the loop on an exception and sat in destroy_process_group(),
    which under NCCL waits for the peers in a collective. Not "never entered": it is tearing down."""
    answers = raw(version, "behind")
    frames = answers["node1"]["ranks"]["3"]["listener"]["threads"][0]["frames"]
    frames[:] = [["/root/work/code/train.py", 54, "main", "dist.destroy_process_group()"],
                 ["/usr/lib/python3/site-packages/torch/distributed/distributed_c10d.py", 2400,
                  "destroy_process_group", "_shutdown_backend(pg)"]]
    found = judge(views_of(answers), shorten)
    assert found.kind == "teardown" and found.culprits == (3,)
    assert found.summary.startswith("rank 3 on node1 is tearing down its process group at ")
    assert "train.py:54 in `main`" in found.summary and "all_reduce #4 (group 0)" in found.summary
    assert "never entered" not in found.summary
