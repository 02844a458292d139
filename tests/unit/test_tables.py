"""Every table nodectl prints reads at 80 columns as at 200: no line wider than the terminal, headers whole, run
ids and node names never split or cut, columns with nothing in them (GPU figures of CPU nodes) left out, and a
preflight fix wrapped with an indent instead of cut mid-word by the terminal."""
from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from rich.console import Console

from nodectl.cli import env_dump, runs, status, top
from nodectl.preflight import judge
from nodectl.preflight.judge import Expectation, NodeFacts
from nodectl.preflight.run import PreflightReport
from nodectl.cli.preflight_table import print_report
from nodectl.preflight.verdict import FAIL, CheckResult

DATA = Path(__file__).resolve().parent.parent / "data" / "probe"
RUN_ID = "20261126-072958-b074"
NODES = ["gpu-node-with-a-long-name-01", "node1"]


def rendered(thing, width: int) -> str:
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=False, color_system=None)
    thing(console) if callable(thing) else console.print(thing)
    return out.getvalue()


def readable(text: str, width: int, whole: list[str], headers: list[str]) -> None:
    lines = text.splitlines()
    assert all(len(line) <= width for line in lines), "\n".join(line for line in lines if len(line) > width)
    assert "…" not in text, text
    for word in whole:
        assert any(word in line for line in lines), f"{word!r} is split or cut at {width} columns:\n{text}"
    # the header lines: those above a rule (a table too wide for the terminal goes on in parts, each with its own)
    header = "  ".join(lines[i - 1] for i, line in enumerate(lines) if line.strip() and set(line.strip()) <= {"─"})
    for name in headers:
        assert re.search(rf"(^|\s){re.escape(name)}(\s|$)", header), f"header {name!r} cut at {width}:\n{text}"


def rank_rows(gpu: bool) -> list[dict]:
    rows = []
    for rank in range(4):
        row = {"node": NODES[rank // 2], "rank": rank, "state": "exited(-15)" if rank == 3 else "running",
               "heartbeat_age": 3.0, "step": 80, "loss": 0.8123, "tokens_per_s": 15757.0, "pid": 123456 + rank}
        if gpu:
            row["gpu"] = {"index": rank % 2, "util": 98.0, "mem_used_mib": 120000, "mem_total_mib": 143771,
                          "temp_c": 61.0, "power_w": 650.0}
        rows.append(row)
    return rows


@pytest.mark.parametrize("width", [80, 200])
def test_top_keeps_headers_whole_and_leaves_out_gpu_columns_of_cpu_nodes(width):
    snap = {"run_id": RUN_ID, "state": "running", "attempt": 0, "elapsed_s": 12.0}
    cpu = rendered(top.render({**snap, "ranks": rank_rows(gpu=False)}), width)
    readable(cpu, width, [RUN_ID, *NODES, "exited(-15)"],
             ["node", "rank", "state", "step", "loss", "tok/s", "beat"])
    assert "util" not in cpu and "power" not in cpu, "GPU columns of CPU nodes hold nothing"
    gpu = rendered(top.render({**snap, "ranks": rank_rows(gpu=True)}), width)
    readable(gpu, width, [RUN_ID, *NODES, "exited(-15)", "117.2/140"],
             ["node", "rank", "state", "step", "loss", "tok/s", "beat", "gpu", "util", "temp", "power"])


@pytest.mark.parametrize("width", [80, 200])
def test_status_table(width):
    text = rendered(status.render(RUN_ID, "running", rank_rows(gpu=False)), width)
    readable(text, width, [RUN_ID, *NODES, "exited(-15)"], ["node", "rank", "state", "heartbeat", "step", "loss"])


@pytest.mark.parametrize("width", [80, 200])
def test_runs_never_splits_a_run_id_and_says_why_a_run_failed(width):
    url = "s3://team-ckpts/very/long/prefix/for/experiments/glm-lora-2026/20261126-072901-b071/"
    rows = [{"run_id": f"20261126-0729{i:02d}-b07{i}", "kind": "train", "state": state, "nodes": NODES,
             "world_size": 16, "ranks_per_node": [8, 8], "started": 1795000000.0 + i,
             "command": "-m nodectl_trainer --config ../config/r.yaml", "cause": cause, "outputs": url if i else None}
            for i, (state, cause) in enumerate([("succeeded", None), ("failed", "stalled: rank 3 on node1 never "
                                                "entered all_reduce #4 (group 0), which ranks 0-2 have been waiting "
                                                "in for 10 s; it is sleeping at hang.py:13")])]
    text = rendered(runs.render(rows), width)
    readable(text, width, [r["run_id"] for r in rows] + ["succeeded", "failed"],
             ["run", "state", "started", "nodes, ranks: command"])
    assert "8 ranks each" in " ".join(text.split()) and " x 16" not in text   # ranks per node, unambiguous
    # the cause and the bucket's URL at full width under the table: the URL whole on one line, to copy
    said = rendered(lambda console: [console.print(line, soft_wrap=True) for line in runs.notes(rows)], width)
    assert f"20261126-072901-b071 outputs: {url}" in said.splitlines()
    assert "never entered all_reduce #4" in said and "hang.py:13" in said


@pytest.mark.parametrize("width", [80, 200])
def test_env_dump_tables(width):
    reports = {name: json.loads((DATA / "cpu-node.json").read_text()) for name in NODES}
    text = rendered(env_dump.nodes_table(reports), width)
    readable(text, width, NODES, ["node", "os"])
    diff = rendered(env_dump.diff_table({"packages.transformers": {NODES[0]: "4.57.1", NODES[1]: "5.24.0"}},
                                        NODES), width)
    readable(diff, width, ["4.57.1", "5.24.0"], ["key"])


@pytest.mark.parametrize("width", [80, 200])
def test_preflight_fixes_wrap_with_an_indent(width):
    report = json.loads((DATA / "h200.json").read_text())
    results = judge.judge_node(NodeFacts(NODES[0], report, "cuda", Expectation(gpus=8, master_port=29500, master_addr="10.0.1.11")), tier="quick")
    hint = ("reboot the node, or reload the nvidia kernel modules (rmmod nvidia_uvm nvidia_drm nvidia_modeset "
            "nvidia; modprobe nvidia) once no process uses the GPUs, so the driver matches the library again")
    results.append(CheckResult(node=NODES[1], check="driver", verdict=FAIL, detail="NVML/RM version mismatch",
                               hint=hint))
    text = rendered(lambda console: print_report(console, PreflightReport(NODES, results)), width)
    readable(text, width, NODES, ["node", "pass", "warn", "fail", "skip", "problems"])
    fix = text[text.index("fix: reboot"):]
    block = fix.split("\n")
    joined = " ".join(line.strip() for line in block[:1 + len(hint) // 20])
    assert " ".join(hint.split()) in " ".join(joined.split()), "the fix is whole, word by word"
    if width == 80:
        assert block[1].startswith("       ") and block[1].strip(), "a wrapped fix goes on indented"


def test_a_heartbeat_written_just_after_the_nodes_clock_reading_is_0s_old_not_minus_0():
    from nodectl.remote.answers import PollAnswer, RankState
    from nodectl.transport import NodeResult
    from nodectl.runs import RunNode

    class Node:
        name = "node0"

    answer = PollAnswer(now=100.0, node_rank=0, alive=1, started=True,
                        ranks=(RankState(rank=0, alive=True, heartbeat={"step": 5, "loss": 1.5}, heartbeat_age=-0.3),))
    run_node = RunNode(node=Node(), node_rank=0, ranks=[0], run_dir="/x")
    [row] = status.rank_rows({"node0": NodeResult(Node(), value=answer)}, [run_node], stall_after=300)
    assert row["heartbeat_age"] == 0.0
    snap = {"run_id": RUN_ID, "state": "running", "attempt": 0, "elapsed_s": 1.0, "ranks": [row]}
    assert "-0s" not in rendered(top.render(snap), 80) and " 0s" in rendered(top.render(snap), 80)


@pytest.mark.parametrize("width", [80, 200])
def test_preflight_all_checks_matrix_goes_on_in_parts_that_repeat_the_node(width):
    report = json.loads((DATA / "h200.json").read_text())
    results = []
    for name in NODES:
        results += judge.judge_node(NodeFacts(name, report, "cuda", Expectation(gpus=8, master_port=29500,
                                                                                master_addr="10.0.1.11")), tier="quick")
    checks = list(dict.fromkeys(r.check for r in results))
    text = rendered(lambda console: print_report(console, PreflightReport(NODES, results), full=True), width)
    readable(text, width, NODES, ["node", *checks])
    parts = text.count("(continued)")
    assert (parts > 0) == (width == 80) or width == 200
