"""The contract between the two sides: the real node-side programs (launchers/runctl/, launchers/probe.py) run
here on a local node, and every answer is parsed by the controller's types (nodectl/remote/answers.py) and judged
by the preflight checks. A key renamed on one side fails here, not silently on a user's cluster."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from nodectl.inventory import parse_inventory
from nodectl.launch.job import JobSpec, plan_job, record_job, settle_job, start_job, stop_run
from nodectl.preflight.judge import Expectation, NodeFacts, judge_cluster, judge_node
from nodectl.preflight.verdict import SKIP
from nodectl.remote import agent, answers, sync
from nodectl.remote.probe_nodes import probe_nodes
from nodectl.transport import Cluster, TransportOptions
from nodectl.runs import RunState

SAVED = Path(__file__).resolve().parents[1] / "data" / "probe"

RANK_SCRIPT = """\
import faulthandler, os, signal, sys, time
from pathlib import Path
import nodectl_metrics
stack = os.environ["NODECTL_STACK_FILE"]
faulthandler.register(signal.SIGUSR1, file=open(stack, "a"), all_threads=True)
Path(stack).with_suffix(".ready").write_text(str(os.getpid()))
print("rank up", flush=True)
nodectl_metrics.report(1, loss=2.5)
time.sleep(120)
"""


@pytest.fixture
def local_node(tmp_path, monkeypatch):
    monkeypatch.setenv("NODECTL_RUNS", str(tmp_path / "runs"))
    monkeypatch.chdir(tmp_path)
    inventory = parse_inventory(f"nodes:\n  - {{host: localhost, name: n0, transport: local, device: cpu, gpus: 1, "
                                f"python: {sys.executable}, workdir: {tmp_path / 'work'}}}\n")
    with Cluster(inventory.nodes, TransportOptions()) as cluster:
        yield inventory, cluster, tmp_path


def one(cluster, node, fn):
    [result] = cluster.fan_out(fn, [node])
    assert result.ok, result.error
    return result.value


def test_every_runctl_answer_parses_into_its_type(local_node):
    inventory, cluster, folder = local_node
    node = inventory.nodes[0]
    (folder / "rank.py").write_text(RANK_SCRIPT)
    project = folder / "project"
    project.mkdir()
    (folder / "rank.py").rename(project / "rank.py")
    files = tuple(sync.project_files(project) + sync.nodectl_files(False, None))
    job = settle_job(plan_job(JobSpec(inventory, command=("rank.py",), sync_dir=str(project), files=files)), cluster)
    run = record_job(job)
    start_job(job, run, cluster, grace=5)
    run_dir = run.nodes()[0].run_dir
    try:
        poll = _until(lambda: one(cluster, node, lambda t: agent.call(t, "poll", run_dir, request={
            "offsets": {"0": 0}})), lambda a: a.ranks[0].heartbeat and "rank up" in a.logs["0"].text)
        assert isinstance(poll, answers.PollAnswer) and poll.alive >= 1 and poll.started and not poll.stopped
        rank = poll.ranks[0]
        assert rank.rank == 0 and rank.alive and isinstance(rank.pid, int) and rank.exit is None
        assert rank.step == 1 and rank.heartbeat_age is not None and rank.log_size > 0
        assert poll.logs["0"].start == 0 and poll.logs["0"].offset == rank.log_size

        _watch_stream(cluster, node, run_dir, rank.log_size)

        sampled = one(cluster, node, lambda t: agent.call(t, "poll", run_dir, request={"gpus": True}))
        assert sampled.gpu_sample is not None and (sampled.gpu_sample.gpus or sampled.gpu_sample.error)

        tail = one(cluster, node, lambda t: agent.call(t, "tail", run_dir, request={"ranks": [0], "lines": 5}))
        assert "rank up" in tail.logs["0"].text

        stacks = one(cluster, node, lambda t: agent.call(t, "stacks", run_dir, timeout=60))
        assert "rank.py" in (stacks.stacks["0"].text or ""), stacks

        diagnosed = one(cluster, node, lambda t: agent.call(t, "diagnose", run_dir, request={"wait": 5}))
        assert isinstance(diagnosed, answers.DiagnoseAnswer) and diagnosed.node_rank == 0
        dump = diagnosed.ranks["0"]
        assert dump.alive and dump.cpu is not None and dump.main_state and "rank up" in dump.log_tail
        main_thread = next(t for t in dump.listener["threads"] if t["main"])
        assert any(frame[0].endswith("rank.py") for frame in main_thread["frames"]), dump.listener
        assert dump.listener["flight"] == {}   # no torch.distributed in this program: nothing imported for it

        stopped = one(cluster, node, lambda t: agent.call(t, "stop", run_dir, request={"grace": 5}))
        assert isinstance(stopped, answers.StopAnswer) and stopped.terminated >= 1 and stopped.left == 0

        after = one(cluster, node, lambda t: agent.call(t, "poll", run_dir))
        assert after.stopped and after.alive == 0 and after.launcher_exit is not None

        packed = one(cluster, node, lambda t: agent.call(t, "pack", run_dir))
        assert packed.entries > 0 and packed.bytes > 0 and packed.archive.startswith(run_dir)
        assert isinstance(one(cluster, node, lambda t: agent.call(t, "cleanup", packed.archive)), answers.Done)
    finally:
        stop_run(run, cluster, 5, RunState.STOPPED)

    port = one(cluster, node, lambda t: agent.call(t, "port", "0"))
    assert port.free and port.port > 0
    identity = one(cluster, node, lambda t: agent.call(t, "identity", node.workdir, request={"hashes": ["0" * 64]}))
    assert identity.identity and identity.missing == ("0" * 64,)
    assert one(cluster, node, lambda t: agent.call(t, "have", node.workdir, request={"hashes": []})).missing == ()
    listener = one(cluster, node, lambda t: agent.call(t, "listen", str(port.port), "10"))
    try:
        reach = one(cluster, node, lambda t: agent.call(t, "connect", "127.0.0.1", str(listener.port)))
        assert reach.ok and reach.ms is not None
        both = one(cluster, node, lambda t: agent.call(t, "route", "127.0.0.1", request={
            "connect": {"host": "127.0.0.1", "port": listener.port}}))   # preflight's one call per node
        assert isinstance(both, answers.RouteAnswer) and both.reach.ok and both.reach.ms is not None
    finally:
        one(cluster, node, lambda t: agent.call(t, "unlisten", str(listener.pid)))
    # a listener on a port from the ephemeral range, reached as another node reaches it; a name resolved there
    ephemeral = one(cluster, node, lambda t: agent.call(t, "listen", "0", "10", request={"ephemeral": True}))
    try:
        low, high = ephemeral.ephemeral_range
        assert low <= ephemeral.ephemeral <= high and ephemeral.port == 0
        peers = one(cluster, node, lambda t: agent.call(t, "route", "127.0.0.1", request={
            "peer_ports": {"127.0.0.1": ephemeral.ephemeral}, "resolve": "localhost"}))
        assert peers.peer_reach["127.0.0.1"].ok, peers
        assert "127.0.0.1" in peers.resolved and peers.resolved_line["text"].split()[0] in ("127.0.0.1", "::1")
        assert "127.0.0.1" in peers.own
    finally:
        one(cluster, node, lambda t: agent.call(t, "unlisten", str(ephemeral.pid)))
    # a peer's listener that expects one connection ends by itself once it has it: nothing to stop afterwards
    once = one(cluster, node, lambda t: agent.call(t, "listen", "0", "30", request={"ephemeral": True, "expect": 1}))
    assert one(cluster, node, lambda t: agent.call(t, "route", "127.0.0.1", request={
        "peer_ports": {"127.0.0.1": once.ephemeral}})).peer_reach["127.0.0.1"].ok
    assert _until(lambda: os.path.exists(f"/proc/{once.pid}"), lambda alive: not alive, timeout=10) is False
    closed = _until(lambda: one(cluster, node, lambda t: agent.call(t, "route", "127.0.0.1", request={
        "peer_ports": {"127.0.0.1": ephemeral.ephemeral}})), lambda a: not a.peer_reach["127.0.0.1"].ok, timeout=10)
    assert "refused" in closed.peer_reach["127.0.0.1"].error   # the listener is gone: nothing listens there now
    route = one(cluster, node, lambda t: agent.call(t, "route", "127.0.0.1"))
    assert isinstance(route, answers.RouteAnswer)


def _until(ask, done, timeout: float = 60):
    deadline = time.time() + timeout
    while True:
        answer = ask()
        if done(answer) or time.time() > deadline:
            return answer
        time.sleep(0.3)


def _watch_stream(cluster, node, run_dir: str, log_size: int) -> None:
    """runctl watch: each line is poll's answer with its `seq`; the watcher moves its log offsets on by itself (the
    second line carries no text already sent); a request line is read (`sent` comes back as `asked`, `gpus` adds a
    sample); it ends when its stdin ends, leaving no process behind."""
    import psutil

    stream = agent.Watching(cluster.transport(node), run_dir, {"offsets": {"0": 0}, "interval": 0.2, "sent": 1.5})
    try:
        first = _until(lambda: stream.next(5), lambda a: a is not None)
        assert isinstance(first, answers.PollAnswer) and first.seq == 1 and first.asked == 1.5
        assert "rank up" in first.logs["0"].text and first.logs["0"].offset == log_size
        second = _until(lambda: stream.next(5), lambda a: a is not None)
        assert second.seq == 2 and second.logs["0"].start == log_size and second.logs["0"].text == ""
        stream.ask({"sent": 7.25, "gpus": True})
        asked = _until(lambda: stream.next(5), lambda a: a is not None and a.asked == 7.25)
        assert asked.gpu_sample is not None
        watcher = [p for p in psutil.process_iter(["cmdline"]) if "watch" in (p.info["cmdline"] or [])
                   and run_dir in " ".join(p.info["cmdline"] or [])]
        assert len(watcher) == 1, watcher
    finally:
        stream.close()
    psutil.wait_procs(watcher, timeout=5)
    assert not any(p.is_running() for p in watcher)
    # a watcher that hears nothing from its controller for `orphan_after` seconds (cut off by the network: its
    # writes would block for good) ends by itself
    orphan = agent.Watching(cluster.transport(node), run_dir, {"interval": 0.2, "orphan_after": 2})
    began = time.monotonic()
    try:
        with pytest.raises(EOFError):
            while time.monotonic() - began < 20:
                orphan.next(1)
    finally:
        orphan.close()
    assert time.monotonic() - began < 10


@pytest.mark.parametrize("raw, words", [
    ({"now": 1.0, "node_rank": 0, "alive": 1}, "`ranks` is missing"),
    ({"now": 1.0, "node_rank": 0, "alive": "1", "ranks": []}, "`alive`: expected a whole number"),
    ({"now": 1.0, "node_rank": 0, "alive": 1, "ranks": [{"rank": 0, "exit": {"code": "x"}}]}, "`code`"),
    ({"now": 1.0, "node_rank": 0, "alive": 1, "ranks": {"0": {}}}, "`ranks`: expected a list"),
    ({"now": 1.0, "node_rank": 0, "alive": 1, "ranks": [], "logs": {"0": {"offset": 1}}}, "`text` is missing"),
])
def test_a_malformed_answer_names_the_field(raw, words):
    with pytest.raises(answers.AnswerError, match=words.replace("`", ".")):
        answers.parse("poll", raw)


def test_this_machines_probe_report_feeds_every_check_it_can(local_node):
    """Judging the live report of this (CPU) node, no check of a fact this machine has is skipped for want of
    facts; and every section and key of the report saved from a node earlier is still produced."""
    inventory, cluster, _ = local_node
    [result] = probe_nodes(cluster, import_torch=True)
    assert result.ok and "error" not in result.value, result
    report = result.value
    facts = NodeFacts("n0", report, "cpu", Expectation(None, 29500, "127.0.0.1"))
    skipped = {r.check: r.detail for r in judge_node(facts, "quick") + judge_cluster({"n0": report, "n1": report},
                                                                                      {"n0": "cpu", "n1": "cpu"})
               if r.verdict == SKIP}
    lacking = {check: detail for check, detail in skipped.items() if "reported no" in detail or "not probed" in detail}
    assert not lacking, lacking
    # the report saved from a machine of the same kind: this project's CPU test machine, or the H200 machine
    kind = "h200.json" if (report.get("gpus") or {}).get("available") else "cpu-node.json"
    saved = json.loads((SAVED / kind).read_text())
    assert _shape(saved) - _shape(report) == set(), "keys the saved report had and the live probe no longer gives"


def test_the_saved_h200_report_feeds_every_gpu_check():
    """The report of the H200 machine (1 GPU, no InfiniBand), judged at the quick tier: each GPU check reaches a
    verdict from facts, not a skip for want of them."""
    report = json.loads((SAVED / "h200.json").read_text())
    facts = NodeFacts("h200", report, "cuda", Expectation(1, 29500, "127.0.0.1"), gpus=1)
    results = {r.check: r for r in judge_node(facts, "quick")}
    assert results["gpus"].verdict == "pass" and "H200" in results["gpus"].detail
    for check in ("torch", "gpu idle", "ecc", "persistence", "pcie link", "thermal", "mig", "xid"):
        assert results[check].verdict != SKIP, results[check]
    assert results["nvlink"].verdict == SKIP and "fewer than 2 GPUs" in results["nvlink"].detail


def _shape(value, prefix: str = "") -> set[str]:
    """Every key path of a report, lists of records by their first element's keys; machine-dependent sections
    (packages, env, the list of NICs) by their own name only."""
    if not isinstance(value, dict):
        return set()
    out = set()
    for key, inner in value.items():
        path = f"{prefix}.{key}" if prefix else key
        out.add(path)
        if path in ("packages", "env", "nics", "modules") or path.startswith("python.path"):
            continue
        if isinstance(inner, list) and inner and isinstance(inner[0], dict):
            out |= _shape(inner[0], path + "[]")
        else:
            out |= _shape(inner, path)
    return out


def test_a_node_failure_is_one_type_with_its_kind_command_exit_code_and_last_lines(tmp_path):
    """What invoke's UnexpectedExit gives per command, nodectl gives per node: a helper that could not run, one
    that answered why it could not, and a node that could not be reached, told apart by `kind`."""
    missing = parse_inventory(f"nodes:\n  - {{host: localhost, name: n0, transport: local, device: cpu, "
                              f"python: /no/such/python3, workdir: {tmp_path / 'w'}}}\n")
    with Cluster(missing.nodes, TransportOptions()) as cluster:
        [result] = cluster.fan_out(lambda t: agent.call(t, "port", "0"))
    assert not result.ok and not result.unreachable
    failure = result.failure
    assert failure.kind == "exited" and failure.command == "runctl port" and failure.exit_code == 127
    assert "not found" in failure.last_lines and "/no/such/python3" in failure.message
    fine = parse_inventory(f"nodes:\n  - {{host: localhost, name: n0, transport: local, device: cpu, "
                           f"python: {sys.executable}, workdir: {tmp_path / 'w2'}}}\n")
    with Cluster(fine.nodes, TransportOptions()) as cluster:
        [answered] = cluster.fan_out(lambda t: agent.call(t, "stop", str(tmp_path / "no-run")))
    assert answered.no_run and answered.failure.kind == "no_run" and not answered.unreachable
    assert "no run at" in answered.error
    gone = parse_inventory("nodes:\n  - {host: 127.0.0.1, port: 1, name: gone, device: cpu}\n")
    with Cluster(gone.nodes, TransportOptions(connect_timeout=2)) as cluster:
        [far] = cluster.fan_out(lambda t: agent.call(t, "port", "0"))
    assert far.failure.kind == "unreachable" and far.unreachable


@pytest.mark.parametrize("saved", ["cpu-node.json", "h200.json"])
def test_reports_saved_from_real_nodes_parse_and_broken_shapes_are_named(saved):
    report = json.loads((SAVED / saved).read_text())
    assert answers.parse_probe(report) == report
    for section, bad, words in (("gpus", ["x"], "`gpus`: expected an object"),
                                ("nics", {"eth0": "up"}, "`nics`: expected a list of objects"),
                                ("disk", "full", "`disk`: expected an object")):
        with pytest.raises(answers.AnswerError, match=words):
            answers.parse_probe({**report, section: bad})
    assert answers.parse_probe({**report, "infiniband": {"error": "no /sys/class/infiniband"}})
    with pytest.raises(answers.AnswerError, match="gpus.devices"):
        answers.parse_probe({**report, "gpus": {"available": True, "devices": "all of them"}})
    assert answers.parse_gpu_job({"devices": [{"index": 0}], "pairs": []})
    with pytest.raises(answers.AnswerError, match="`pairs`"):
        answers.parse_gpu_job({"devices": [], "pairs": "none"})
