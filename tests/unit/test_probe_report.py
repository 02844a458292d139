"""The probe report as typed sections (nodectl/probe_report.py): what real nodes sent reads back whole, and what a
hostile or broken node sends reads as unknown, never as a crash or a wrong fact."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from nodectl.probe_report import GpuDevice, ProbeReport

DATA = Path(__file__).resolve().parents[1] / "data" / "probe"


def _dropped(typed, raw, where: str) -> list[str]:
    """Every declared field whose value the node sent (not None) but the typed report lost."""
    lost = []
    for f in dataclasses.fields(typed):
        if f.name in ("raw", "error") or not isinstance(raw, dict) or raw.get(f.name) is None:
            continue
        value = getattr(typed, f.name)
        if value is None or value == () and raw[f.name] != []:
            lost.append(f"{where}.{f.name} = {raw[f.name]!r}")
        elif dataclasses.is_dataclass(value):
            lost += _dropped(value, raw[f.name], f"{where}.{f.name}")
        elif isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0]):
            for i, (item, sent) in enumerate(zip(value, raw[f.name])):
                lost += _dropped(item, sent, f"{where}.{f.name}[{i}]")
    return lost


@pytest.mark.parametrize("name", ["h200", "cpu-node"])
def test_a_real_nodes_report_reads_back_with_nothing_lost(name):
    raw = json.loads((DATA / f"{name}.json").read_text())
    report = ProbeReport.of(raw)
    assert _dropped(report, raw, "report") == []
    assert report.raw is raw and ProbeReport.of(report) is report   # parsed once
    assert report.env == raw["env"] and report.packages == raw["packages"]
    if name == "h200":
        gpu = report.gpus.devices[0]
        assert (gpu.name, gpu.pcie_width, gpu.clock_events, gpu.fabric.state) == ("NVIDIA H200", 16, ("gpu idle",), 0)
        assert report.gpus.read == report.gpus.devices and report.gpus.lost == ()


def test_what_a_broken_or_hostile_node_sends_reads_as_unknown():
    raw = {"gpus": {"available": "yes", "count": "8", "devices": [
               {"index": 0, "name": "H100", "pcie_width": "16", "compute_processes": [{"pid": "1"}, 5],
                "clock_events": "hw slowdown", "fabric": [1]},
               {"index": 1, "error": "NVMLError_GpuIsLost"}, "not a GPU"]},
           "limits": {"nofile_soft": "unlimited", "nproc_soft": True, "pids_max": 12.5},
           "disk": {"free_bytes": 1 << 40, "scratch": {"tmp": {"writable": False, "write_error": "EROFS"}},
                    "unsafe": "yes"},
           "infiniband": {"error": "PermissionError: /sys/class/infiniband"}, "nics": "eth0",
           "env": {"error": "denied"}, "memory": [1, 2], "os": {"hostname_resolves": {"error": "no answer"}}}
    report = ProbeReport.of(raw)
    lost = report.gpus.lost[0]
    assert (report.gpus.available, report.gpus.count) == (None, None)     # a string is no count, no yes
    first = report.gpus.read[0]
    assert first == GpuDevice(index=0, name="H100", compute_processes=(first.compute_processes[0],))
    assert first.compute_processes[0].pid is None and first.clock_events is None and first.fabric is None
    assert (lost.index, lost.error, lost.label) == (1, "NVMLError_GpuIsLost", "GPU1")
    assert (report.limits.nofile_soft, report.limits.nproc_soft, report.limits.pids_max) == ("unlimited", None, None)
    assert report.disk.free_bytes == 1 << 40 and report.disk.unsafe is None
    assert report.disk.scratch.tmp.writable is False and report.disk.scratch.cache is None
    assert report.infiniband == () and report.infiniband_error == "PermissionError: /sys/class/infiniband"
    assert report.nics == () and report.env is None and report.memory.total_bytes is None
    assert report.unreadable("infiniband") == "infiniband facts could not be read (PermissionError: /sys/class/infiniband)"
    assert report.unreadable("cgroup") == "the probe reported no cgroup facts" and report.unreadable("disk") is None
    assert report.os.hostname_resolves == {"error": "no answer"}
    assert ProbeReport.of("not a report") == ProbeReport.of({})
