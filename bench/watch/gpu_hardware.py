"""What the hardware watch (launchers/runctl/hardware.py) reads on a real GPU node and what one look costs: every
GPU's counters as NVML gives them (ECC, row remaps, NVLink errors; None where the GPU does not support one), the
ports, whether the kernel log is readable, and the milliseconds of a watch stream's look (reads every 5 s) and of a
one-shot look (`status`), against the pace sample runctl already takes at each poll (node_cpu). Run under runctl's
own interpreter flags (-S), as on a node:

    python -S bench/watch/gpu_hardware.py --looks 50
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "launchers"))
from runctl import hardware  # noqa: E402
from runctl.pace import node_cpu  # noqa: E402


def timed(function, times: int) -> list[float]:
    out = []
    for _ in range(times):
        began = time.perf_counter()
        function()
        out.append((time.perf_counter() - began) * 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--looks", type=int, default=50)
    args = parser.parse_args()
    run_dir = tempfile.mkdtemp(prefix="nodectl-hw-")
    os.makedirs(os.path.join(run_dir, "state"))
    with open(os.path.join(run_dir, "node.json"), "w", encoding="utf-8") as handle:
        json.dump({"device": "cuda", "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES")}, handle)
    open(os.path.join(run_dir, "state", "boot"), "w").close()
    began = time.perf_counter()
    hardware.baseline(run_dir)
    baseline_ms = (time.perf_counter() - began) * 1e3
    with open(os.path.join(run_dir, "state", "hardware.json"), encoding="utf-8") as handle:
        base = json.load(handle)
    print(f"baseline (runctl start) {baseline_ms:.1f} ms; parts: {len(base['counters'])}")
    for part, row in base["counters"].items():
        print(f"  {part}: {json.dumps(row)}")
    first = hardware.look(run_dir, time.time())
    print(f"events on a healthy node: {first['events']}; notes: {first['notes']}")
    ticks = iter(range(1, 1 << 30))   # each look 10 s after the last: a stream reads afresh every time
    stream = timed(lambda: hardware.look(run_dir, time.time() + 10 * next(ticks), stream=True), args.looks)
    hardware.close(run_dir)
    oneshot = timed(lambda: hardware.look(run_dir, time.time()), args.looks)
    pace = timed(node_cpu, args.looks)
    for name, figures in (("stream look (every 5 s)", stream), ("one-shot look (status)", oneshot),
                          ("node_cpu (every poll, reference)", pace)):
        print(f"{name:<36} median {statistics.median(figures):7.2f} ms  p90 "
              f"{sorted(figures)[int(0.9 * len(figures)) - 1]:7.2f} ms")
    print(f"stream look per second of watching (one look per {hardware.EVERY:.0f} s): "
          f"{statistics.median(stream) / hardware.EVERY:.2f} ms/s")


if __name__ == "__main__":
    main()
