"""Hardware seen while a run runs (issue 68): an Xid in the kernel log, ECC and row-remap counts that grow, a GPU
lost, a port error counter that climbs, each named with its node, part, counter and rise; what makes a part of the
run unusable fails it; resets, an unreadable kernel log and a CPU run's GPUs are said, not mistaken. The node side
reads a fake NVML (tests/support/fake_pynvml.py), a kernel log and a sysfs tree written here; the SSH test in
tests/integration/test_hardware_ssh.py runs the whole path on isolated nodes."""
from __future__ import annotations

import json
import sys
import time

import pytest

from nodectl.remote.answers import parse
from nodectl.resources import resource_dir
from nodectl.transport import NodeResult

sys.path.insert(0, str(resource_dir("launchers")))
from runctl import hardware  # noqa: E402

pytestmark = pytest.mark.quick


@pytest.fixture
def node(tmp_path, monkeypatch):
    """A node with two GPUs (fake NVML), one InfiniBand port and a kernel log, and a run folder on it."""
    from support import fake_pynvml

    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml)
    nvml = tmp_path / "nvml.json"
    monkeypatch.setenv("FAKE_NVML", str(nvml))
    gpus = [{"pci": "00000000:3B:00.0", "uuid": "GPU-aaa", "ecc_uncorrected": 0, "ecc_corrected": 4,
             "remap_uncorrectable": 0, "remap_failure": 0, "nvlink": [[0, 0, 0, 0], [1, 0, 0, 0]]},
            {"pci": "00000000:5E:00.0", "uuid": "GPU-bbb", "ecc_uncorrected": 1, "ecc_corrected": 0,
             "remap_uncorrectable": 0, "remap_failure": 0}]
    nvml.write_text(json.dumps({"gpus": gpus}))
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(_kmsg(1, time.monotonic() - 5, "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus."))
    monkeypatch.setattr(hardware, "KMSG", str(kmsg))
    ports = tmp_path / "infiniband"
    counters = ports / "mlx5_0" / "ports" / "1" / "counters"
    counters.mkdir(parents=True)
    for name in hardware.PORT_COUNTERS:
        (counters / name).write_text("0\n")
    monkeypatch.setattr(hardware, "INFINIBAND", str(ports))
    run_dir = tmp_path / "run"
    (run_dir / "state").mkdir(parents=True)
    (run_dir / "node.json").write_text(json.dumps({"device": "cuda", "cuda_visible": "0,1"}))
    (run_dir / "state" / "boot").write_text("boot")
    hardware.baseline(str(run_dir))
    return {"run": str(run_dir), "nvml": nvml, "gpus": gpus, "kmsg": kmsg, "counters": counters}


def _kmsg(seq: int, monotonic: float, text: str) -> str:
    return f"3,{seq},{int(monotonic * 1e6)},-;{text}\n"


def tmp_path_of(node):
    from pathlib import Path

    return Path(node["run"])


def _set(node, index, **values):
    node["gpus"][index].update(values)
    node["nvml"].write_text(json.dumps({"gpus": node["gpus"]}))


def _answer(node, **request) -> NodeResult:
    """What `status` gets from the node: the look through runctl's poll answer and nodectl's own parser."""
    from nodectl.hardware import events_of

    look = hardware.look(node["run"], time.time(), **request)
    raw = {"now": time.time(), "node_rank": 1, "alive": 1, "ranks": [], "hardware": look}
    return events_of({"node1": _result(raw)}), look


def _result(raw):
    return NodeResult(None, value=parse("poll", raw))


def test_each_fault_is_named_with_its_part_counter_and_rise_and_what_breaks_the_run_is_fatal(node):
    assert _answer(node)[0] == [], "an Xid from before the run and the counts it started with are not its events"
    with node["kmsg"].open("a") as log:
        log.write(_kmsg(2, time.monotonic(), "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has "
                                             "fallen off the bus."))
        log.write(_kmsg(3, time.monotonic(), "usb 1-1: new device"))
        log.write(_kmsg(4, time.monotonic(), "NVRM: Xid (PCI:0000:5e:00): 92, pid=4242, High single-bit ECC"))
    _set(node, 1, ecc_uncorrected=3, ecc_corrected=7)
    _set(node, 0, nvlink=[[0, 0, 0, 0], [1, 5, 0, 2]])
    (node["counters"] / "symbol_error").write_text("12\n")
    events, _ = _answer(node)
    said = {(name, e.part, e.counter): e for name, e in events}
    xid = said[("node1", "GPU 0", "Xid 79 (GPU has fallen off the bus)")]
    assert xid.rise == 1 and xid.fatal and "pid=4242" in xid.text
    assert not said[("node1", "GPU 1", "Xid 92 (high single-bit ECC error rate)")].fatal
    ecc = said[("node1", "GPU 1", "uncorrectable ECC errors")]
    assert (ecc.rise, ecc.now, ecc.fatal) == (2, 3, True)
    assert said[("node1", "GPU 1", "corrected ECC errors")].rise == 7 and \
        not said[("node1", "GPU 1", "corrected ECC errors")].fatal
    assert said[("node1", "GPU 0", "NVLink errors (replay, recovery, CRC)")].rise == 7
    port = said[("node1", "port mlx5_0/1", "symbol errors")]
    assert (port.rise, port.fatal) == (12, False)
    assert events[0][1].fatal, "fatal events first: the one that fails the run is named first"

    from nodectl.hardware import describe, fatal, lines

    states = {"node1": _result({"now": 0, "node_rank": 1, "alive": 1, "ranks": [],
                                "hardware": hardware.look(node["run"], time.time())})}
    name, first = fatal(states)
    assert name == "node1" and describe(name, first).startswith(
        "GPU 0 of node1: 1 Xid 79 (GPU has fallen off the bus) since the run started, last 0s ago: the part cannot go on")
    assert "hardware: port mlx5_0/1 of node1: symbol errors rose by 12 to 12 since the run started" in \
        "\n".join(lines(states))


def test_a_gpu_lost_or_gone_from_the_list_is_fatal_on_a_gpu_run_and_only_named_on_a_cpu_run(node):
    _set(node, 1, lost=True)
    events, _ = _answer(node)
    assert [(e.part, e.counter, e.fatal) for _, e in events] == [("GPU 1", "lost", True)]
    node["gpus"].pop()
    node["gpus"][0]["lost"] = False
    node["nvml"].write_text(json.dumps({"gpus": node["gpus"]}))
    events, _ = _answer(node)
    assert [(e.part, e.counter, e.fatal) for _, e in events] == [("GPU 1", "lost", True)]
    assert "no longer listed by NVML" in events[0][1].text

    (tmp_path_of(node) / "node.json").write_text(json.dumps({"device": "cpu"}))
    events, _ = _answer(node)
    assert [(e.part, e.fatal) for _, e in events] == [("GPU 1", False)], "a CPU run's node: its GPUs are not the run's"


def test_a_gpu_lost_before_the_watch_reads_again_still_tells_what_a_look_between_saw_rise(node):
    """The watch reads every 5 s; a `status` between two of its reads saw GPU 1's corrected ECC errors rise, then
    the GPU fell off the bus. The watch's next read cannot read the counters of a lost GPU: it tells the rise as
    last read with the loss. A GPU gone from NVML's list the same."""
    stream = hardware.look(node["run"], time.time(), stream=True)
    assert stream["events"] == []
    _set(node, 1, ecc_corrected=5)
    _set(node, 0, ecc_corrected=6)
    events, _ = _answer(node)      # status, between two reads of the watch
    assert {(e.part, e.counter, e.rise) for _, e in events} == {("GPU 1", "corrected ECC errors", 5),
                                                                 ("GPU 0", "corrected ECC errors", 2)}
    _set(node, 1, lost=True)
    node["gpus"].pop(0)            # and GPU 0 is gone from the list
    node["nvml"].write_text(json.dumps({"gpus": node["gpus"]}))
    later = hardware.look(node["run"], time.time() + hardware.EVERY, stream=True)
    told = {(e["part"], e["counter"], e["rise"], e["fatal"]) for e in later["events"]}
    assert told == {("GPU 1", "corrected ECC errors", 5, False), ("GPU 1", "lost", 1, True),
                    ("GPU 0", "corrected ECC errors", 2, False), ("GPU 0", "lost", 1, True)}, told
    hardware.close(node["run"])


def test_a_counter_that_goes_back_is_a_reset_said_once_and_counted_from_there(node):
    (node["counters"] / "link_downed").write_text("4\n")
    events, look = _answer(node)
    assert [(e.counter, e.rise) for _, e in events] == [("link down events", 4)]
    (node["counters"] / "link_downed").write_text("1\n")
    events, look = _answer(node)
    assert [(e.counter, e.rise) for _, e in events] == [("link down events", 4)], "what it rose before is kept"
    assert look["notes"] == ["port mlx5_0/1: link down events went back from 4 to 1 (a reset): counted on from 1"]
    (node["counters"] / "link_downed").write_text("3\n")
    events, look = _answer(node)
    assert [(e.counter, e.rise) for _, e in events] == [("link down events", 6)] and look["notes"] == []


def test_an_unreadable_kernel_log_is_said_and_the_counters_are_still_read(node, monkeypatch):
    monkeypatch.setattr(hardware, "KMSG", str(node["kmsg"]) + ".missing")
    _set(node, 0, ecc_uncorrected=1)
    events, look = _answer(node)
    assert [(e.part, e.counter) for _, e in events] == [("GPU 0", "uncorrectable ECC errors")]
    assert len(look["notes"]) == 1 and "kernel log" in look["notes"][0] and "not readable" in look["notes"][0]


def test_a_stream_reads_the_kernel_log_once_and_counts_each_record_once(node):
    with node["kmsg"].open("a") as log:
        log.write(_kmsg(7, time.monotonic(), "NVRM: Xid (PCI:0000:3b:00): 48, pid=1, DBE"))
    first = hardware.look(node["run"], time.time(), stream=True)
    again = hardware.look(node["run"], time.time() + hardware.EVERY + 1, stream=True)
    with node["kmsg"].open("a") as log:
        log.write(_kmsg(8, time.monotonic(), "NVRM: Xid (PCI:0000:3b:00): 48, pid=1, DBE"))
    later = hardware.look(node["run"], time.time() + 2 * hardware.EVERY + 2, stream=True)
    hardware.close(node["run"])
    assert [e["rise"] for e in first["events"]] == [1] and [e["rise"] for e in again["events"]] == [1]
    assert [(e["counter"], e["rise"], e["fatal"]) for e in later["events"]] == [
        ("Xid 48 (double-bit ECC error)", 2, True)]


def test_notices_tell_each_event_once_and_again_as_it_rises_and_the_history_names_the_part():
    from nodectl.hardware import HardwareNotices
    from nodectl.preflight.history import judge_hardware

    told, noted, kept = [], [], []
    notices = HardwareNotices(tell=lambda n, e: told.append((n, e.rise)), note=lambda n, t: noted.append(t),
                              remember=lambda n, e: kept.append((n, e)))

    def states(rise, note="the kernel log (/dev/kmsg) is not readable here"):
        event = {"part": "GPU 3", "counter": "Xid 79 (GPU has fallen off the bus)", "rise": rise, "fatal": True,
                 "time": time.time()}
        return {"gpu07": _result({"now": 0, "node_rank": 0, "alive": 1, "ranks": [],
                                  "hardware": {"events": [event], "notes": [note]}})}

    notices(states(1))
    notices(states(1))
    notices(states(2))
    assert told == [("gpu07", 1), ("gpu07", 2)] and len(noted) == 1 and len(kept) == 2

    now = time.time()
    past = [{"time": now - 86400 * 3, "hardware": {"run": "r1", "node": "gpu07", "part": "GPU 3",
                                                   "counter": "Xid 79 (GPU has fallen off the bus)", "rise": 1,
                                                   "fatal": True}},
            {"time": now - 3600, "hardware": {"run": "r2", "node": "gpu07", "part": "GPU 3",
                                              "counter": "Xid 79 (GPU has fallen off the bus)", "rise": 1,
                                              "fatal": True}},
            {"time": now - 3500, "hardware": {"run": "r2", "node": "gpu07", "part": "GPU 3",
                                              "counter": "Xid 79 (GPU has fallen off the bus)", "rise": 1,
                                              "fatal": True}},
            {"time": now - 86400 * 90, "hardware": {"run": "r0", "node": "gpu07", "part": "GPU 5", "counter": "lost",
                                                    "rise": 1, "fatal": True}},
            {"time": now, "hardware": "not a record"}]
    results = judge_hardware(["gpu07", "gpu08"], past, now=now)
    assert [(r.node, r.verdict) for r in results] == [
        ("gpu07", "warn")]
    assert results[0].detail.startswith("GPU 3 of gpu07: 2 Xid 79 (GPU has fallen off the bus) in 2 run(s) of the "
                                        "last 30 days") and "it stopped a run" in results[0].detail


def test_exclude_failed_leaves_out_the_node_whose_part_broke_without_asking_it_again():
    """A node whose GPU fell off the bus is out of the next attempt as a lost node is: the quick check runs on the
    others only (asked again, the broken one may answer and pass: its GPU 1 still does)."""
    from contextlib import contextmanager

    from nodectl.inventory import parse_inventory
    from nodectl.launch.attend import _passing_nodes
    from nodectl.launch.job import JobSpec, plan_job
    from nodectl.preflight.run import PreflightReport
    from nodectl.watch import Failure, FailureKind

    inventory = parse_inventory("nodes:\n  - {host: a, name: node0}\n  - {host: b, name: node1}\n"
                                "  - {host: c, name: node2}\n")
    job = plan_job(JobSpec(inventory=inventory, command=("t.py",), sync_dir=".", files=()))
    checked = []

    class Gate:
        def check(self, inventory, session, gpus, advance):
            checked.extend(n.name for n in inventory.nodes)
            return PreflightReport(nodes=[n.name for n in inventory.nodes], results=[])

    class Session:
        @contextmanager
        def progress(self, label, total):
            yield lambda *a: None

    failure = Failure(kind=FailureKind.HARDWARE, node="node1", detail="GPU 0 of node1: 1 Xid 79 ...")
    told = []
    kept, left_out = _passing_nodes(job, failure, Session(), told.append, Gate())
    assert checked == ["node0", "node2"]
    assert [n.name for n in kept.nodes] == ["node0", "node2"] and [n.index for n in kept.nodes] == [0, 1]
    assert [entry["node"]["name"] for entry in left_out] == ["node1"]
    assert any(getattr(event, "node", None) == "node1" for event in told)
