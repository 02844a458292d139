#!/usr/bin/env python3
"""Preflight's GPU job on one node (the default tier): every visible GPU measured under load, and every GPU pair's
peer copy checked. Prints one JSON document. Sent over stdin; imports nothing from nodectl.

Per GPU, all GPUs at once (as training loads them): bf16 GEMM TFLOP/s (8192^3 matmuls) and HBM copy bandwidth
(1 GiB device-to-device copies, bytes read + written), while NVML is sampled for clock events (throttling), the
hottest temperature and the PCIe link reached. Then one GPU at a time: host-to-device and device-to-host
bandwidth from pinned memory (256 MiB). Times are wall clock after torch.cuda.synchronize: what a rank waits for.

P2P can report "available" and still fail or corrupt data (ACS, IOMMU); only a checked copy tells, so every
ordered pair gets one, with its bandwidth.
"""
from __future__ import annotations

import json
import threading
import time

GEMM_N, GEMM_ITERS = 8192, 100
HBM_BYTES, HBM_ITERS = 1 << 30, 50
HOST_BYTES, HOST_ITERS = 256 << 20, 10
P2P_BYTES = 64 << 20
EVENT_BITS = {0x4: "sw power cap", 0x8: "hw slowdown", 0x20: "sw thermal slowdown", 0x40: "hw thermal slowdown",
              0x80: "hw power brake"}


def _timed(torch, device, fn, iters: int) -> float:
    fn()  # warm-up: kernels chosen, memory touched
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize(device)
    return time.perf_counter() - started


def load_one(torch, index: int, out: dict) -> None:
    device = torch.device("cuda", index)
    try:
        a = torch.randn(GEMM_N, GEMM_N, dtype=torch.bfloat16, device=device)
        b, c = torch.randn_like(a), torch.empty_like(a)
        seconds = _timed(torch, device, lambda: torch.mm(a, b, out=c), GEMM_ITERS)
        out["gemm_tflops"] = round(2 * GEMM_N ** 3 * GEMM_ITERS / seconds / 1e12, 1)
        del a, b, c
        x = torch.empty(HBM_BYTES // 4, dtype=torch.float32, device=device)
        y = torch.empty_like(x)
        seconds = _timed(torch, device, lambda: y.copy_(x), HBM_ITERS)
        out["hbm_gbps"] = round(2 * HBM_BYTES * HBM_ITERS / seconds / 1e9, 1)
        del x, y
    except RuntimeError as exc:  # out of memory, a GPU that fell off the bus
        out["error"] = str(exc).splitlines()[0]
    finally:
        torch.cuda.empty_cache()


def host_copies(torch, index: int, out: dict) -> None:
    device = torch.device("cuda", index)
    try:
        host = torch.empty(HOST_BYTES, dtype=torch.uint8, pin_memory=True)
        on_gpu = torch.empty(HOST_BYTES, dtype=torch.uint8, device=device)
        seconds = _timed(torch, device, lambda: on_gpu.copy_(host, non_blocking=True), HOST_ITERS)
        out["h2d_gbps"] = round(HOST_BYTES * HOST_ITERS / seconds / 1e9, 1)
        seconds = _timed(torch, device, lambda: host.copy_(on_gpu, non_blocking=True), HOST_ITERS)
        out["d2h_gbps"] = round(HOST_BYTES * HOST_ITERS / seconds / 1e9, 1)
        del host, on_gpu
    except RuntimeError as exc:
        out["error"] = str(exc).splitlines()[0]


class Sampler:
    """NVML read every 50 ms while the GPUs are loaded: clock event reasons seen (OR of the masks), hottest
    temperature, and the fastest PCIe generation and width reached (an idle link trains down to save power)."""

    def __init__(self, uuids: list) -> None:
        self.uuids, self.samples = uuids, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:
            return
        try:
            handles = [pynvml.nvmlDeviceGetHandleByUUID(u) for u in self.uuids]
            while True:
                for index, handle in enumerate(handles):
                    self._sample(pynvml, index, handle)
                if self._stop.wait(0.05):
                    break
        except Exception:
            pass
        finally:
            pynvml.nvmlShutdown()

    def _sample(self, pynvml, index: int, handle) -> None:
        entry = self.samples.setdefault(index, {"events": 0, "temperature_c": 0, "pcie_gen": 0, "pcie_width": 0})
        for key, call in (("events", lambda: pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle)),
                          ("temperature_c", lambda: pynvml.nvmlDeviceGetTemperature(handle, 0)),
                          ("pcie_gen", lambda: pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)),
                          ("pcie_width", lambda: pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle))):
            try:
                value = call()
            except Exception:
                continue
            entry[key] = entry[key] | value if key == "events" else max(entry[key], value)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def result(self, index: int) -> dict:
        entry = dict(self.samples.get(index) or {})
        if "events" in entry:
            events = entry.pop("events")
            entry["clock_events"] = [name for bit, name in EVENT_BITS.items() if events & bit]
        return entry


def peer_pairs(torch, count: int) -> list:
    pairs = []
    numel = P2P_BYTES // 4
    for src in range(count):
        data = torch.randint(-2**31, 2**31 - 1, (numel,), dtype=torch.int32, device=f"cuda:{src}")
        expected = data.cpu()
        for dst in range(count):
            if src == dst:
                continue
            entry = {"src": src, "dst": dst, "peer_access": torch.cuda.can_device_access_peer(src, dst)}
            try:
                copy = data.to(f"cuda:{dst}")
                torch.cuda.synchronize(src), torch.cuda.synchronize(dst)
                entry["ok"] = bool(torch.equal(copy.cpu(), expected))
                started = time.perf_counter()
                for _ in range(5):
                    copy.copy_(data, non_blocking=True)
                torch.cuda.synchronize(src), torch.cuda.synchronize(dst)
                entry["gbps"] = 5 * numel * 4 / (time.perf_counter() - started) / 1e9
            except RuntimeError as exc:  # e.g. "CUDA error: invalid argument"
                entry.update(ok=False, error=str(exc).splitlines()[0], gbps=0.0)
            pairs.append(entry)
        del data
    return pairs


def main() -> None:
    import torch

    started = time.perf_counter()
    count = torch.cuda.device_count()
    uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(count)]
    devices = [{"index": i, "name": torch.cuda.get_device_name(i)} for i in range(count)]
    with Sampler([u if u.startswith("GPU-") else f"GPU-{u}" for u in uuids]) as sampler:
        threads = [threading.Thread(target=load_one, args=(torch, i, devices[i])) for i in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    for index in range(count):
        devices[index].update(sampler.result(index))
        host_copies(torch, index, devices[index])
    pairs = peer_pairs(torch, count) if count >= 2 else []
    print(json.dumps({"gpus": count, "devices": devices, "pairs": pairs,
                      "elapsed_s": round(time.perf_counter() - started, 2)}))


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:  # the checks report it; the rest of preflight goes on
        print(json.dumps({"error": f"{exc.__class__.__name__}: {exc}"}))
