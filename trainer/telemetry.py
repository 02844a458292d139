"""GPU telemetry through NVML, sampled by a background thread of each node's first rank into
$NODECTL_RUN_DIR/metrics/telemetry.jsonl. Absent, without error, where there is no NVML (CPU nodes)."""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path


class Telemetry:
    def __init__(self, folder: Path, interval: float = 5.0) -> None:
        self.path, self.interval = folder / "telemetry.jsonl", interval
        self._stop = threading.Event()
        self._thread = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
        except Exception:  # no driver or no nvidia-ml-py: nothing to sample
            self._nvml = None

    def start(self) -> "Telemetry":
        if self._nvml and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            self._thread = threading.Thread(target=self._run, name="nodectl-telemetry", daemon=True)
            self._thread.start()
        return self

    def _devices(self) -> list[int]:
        """This node's GPUs: NVML numbers every GPU of the machine and ignores CUDA_VISIBLE_DEVICES."""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        if visible and all(part.strip().isdigit() for part in visible.split(",")):
            return [int(part) for part in visible.split(",")]
        return list(range(self._nvml.nvmlDeviceGetCount()))

    def _sample(self) -> list[dict]:
        nvml, rows = self._nvml, []
        for index in self._devices():
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            util = nvml.nvmlDeviceGetUtilizationRates(handle)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            rows.append({"gpu": index, "util": util.gpu, "mem_util": util.memory, "mem_used": memory.used,
                         "power_w": nvml.nvmlDeviceGetPowerUsage(handle) / 1000,
                         "temp_c": nvml.nvmlDeviceGetTemperature(handle, 0),
                         "sm_clock": nvml.nvmlDeviceGetClockInfo(handle, 1)})
        return rows

    def _run(self) -> None:
        node = os.environ.get("NODECTL_NODE_RANK", "0")
        with open(self.path, "a", encoding="utf-8") as handle:
            while True:
                try:
                    handle.write(json.dumps({"time": time.time(), "node": node, "gpus": self._sample()}) + "\n")
                    handle.flush()
                except Exception:  # a sampling error must never disturb training
                    pass
                if self._stop.wait(self.interval):
                    break

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=self.interval + 1)
