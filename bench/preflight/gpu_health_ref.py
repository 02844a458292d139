"""A plain torch measurement of what preflight's GPU job (launchers/gpuhealth.py) reports, at its best settings:
bf16 GEMM at n = 4096, 8192 and 16384 (the best kept), HBM copy of 256 MiB, 1 GiB and 4 GiB (the best kept),
pinned host copies of 1 GiB, each GPU alone, timed with CUDA events. One JSON line per GPU.

    python bench/preflight/gpu_health_ref.py
"""
from __future__ import annotations

import json

import torch


def timed(fn, iters: int) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def gpu(index: int) -> dict:
    torch.cuda.set_device(index)
    gemm = 0.0
    for n in (4096, 8192, 16384):
        a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        b, c = torch.randn_like(a), torch.empty_like(a)
        gemm = max(gemm, 2 * n ** 3 * 50 / timed(lambda: torch.mm(a, b, out=c), 50) / 1e12)
        del a, b, c
    hbm = 0.0
    for size in (256 << 20, 1 << 30, 4 << 30):
        x = torch.empty(size, dtype=torch.uint8, device="cuda")
        y = torch.empty_like(x)
        hbm = max(hbm, 2 * size * 50 / timed(lambda: y.copy_(x), 50) / 1e9)
        del x, y
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    h2d = (1 << 30) * 10 / timed(lambda: dev.copy_(host, non_blocking=True), 10) / 1e9
    d2h = (1 << 30) * 10 / timed(lambda: host.copy_(dev, non_blocking=True), 10) / 1e9
    return {"index": index, "gemm_tflops": round(gemm, 1), "hbm_gbps": round(hbm, 1), "h2d_gbps": round(h2d, 1),
            "d2h_gbps": round(d2h, 1)}


if __name__ == "__main__":
    for i in range(torch.cuda.device_count()):
        print(json.dumps(gpu(i)), flush=True)
