#!/usr/bin/env python3
"""Preflight's collective test, started by torchrun on every selected node and rank (nodectl's launch path).

All-reduce (sum, float32, like nccl-tests' all_reduce_perf) from the smallest to the largest size: checks the
result on every rank and measures bus bandwidth, busbw = algbw x 2(n-1)/n. Every rank reports whether its
result was right; rank 0 prints one line `NODECTL_COLLECTIVE {json}`. Imports nothing from nodectl.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def measure(tensor: torch.Tensor, iters: int, sync) -> float:
    for _ in range(2):
        dist.all_reduce(tensor)
    sync()
    started = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor)
    sync()
    return (time.perf_counter() - started) / iters


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--min-bytes", type=int, default=1 << 20)
    parser.add_argument("--max-bytes", type=int, default=1 << 30)
    parser.add_argument("--budget-s", type=float, default=1.0, help="rough time per size")
    parser.add_argument("--deadline-s", type=float, default=120.0,
                        help="longest wait for any peer or collective (torch's defaults: 10 min NCCL, 30 min gloo)")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available() and os.environ.get("NODECTL_DEVICE") != "cpu"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo", device_id=device if on_gpu else None,
                            timeout=timedelta(seconds=args.deadline_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    results, size = [], args.min_bytes
    while size <= args.max_bytes:
        count = size // 4
        tensor = torch.full((count,), float(rank + 1), device=device)
        dist.all_reduce(tensor)
        expected = world * (world + 1) / 2
        ok = torch.tensor([1.0 if bool((tensor == expected).all()) else 0.0], device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        probe = torch.tensor([measure(tensor, 1, sync)], device=device)
        dist.all_reduce(probe, op=dist.ReduceOp.MAX)  # every rank must run the same number of all-reduces
        iters = max(3, min(200, int(args.budget_s / max(probe.item(), 1e-6))))
        seconds = torch.tensor([measure(tensor, iters, sync)], device=device)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        algbw = size / seconds.item() / 1e9
        results.append({"bytes": size, "ok": bool(ok.item()), "time_us": seconds.item() * 1e6, "iters": iters,
                        "algbw_gbs": algbw, "busbw_gbs": algbw * 2 * (world - 1) / world})
        size *= 2
    if rank == 0:
        print("NODECTL_COLLECTIVE " + json.dumps({"world": world, "backend": dist.get_backend(), "sizes": results}),
              flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
