"""What the expert layout's token exchange costs, and how much of it is the host sync (issue 54).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        torchrun --nproc-per-node 2 bench/moe/moe_exchange.py [--layers 24] [--tokens 8192] [--steps 20]

Each rank routes its tokens (top-8 of 128 experts, uniform at random, Qwen3-30B-A3B's widths: hidden 2048, expert
intermediate 768) through `--layers` expert layers, forward and backward, six ways in turn, each timed by the
wall clock after a CUDA synchronize:

- before: the exchange as it was (the received rows reordered by indexing, whose backward is a scatter-add, and a
  zero row always added);
- exchange: the trainer's `ExpertShard.exchange` (split sizes read on the host once per layer, then two
  all_to_all_single with those sizes) around the experts' grouped products on this rank's 64 experts;
- counts sync: `even` below, after the split sizes' own exchange and host read (what the host sync costs);
- permute: `even` below, after the old reordering of the rows (what that costs);
- even: the same rows moved with even split sizes known ahead (no host sync, the same bytes), the same products:
  what a device-side exchange could at best reach;
- local: no exchange, the products on the local rows (what replicate pays for its experts).

exchange - even is what the split sizes cost (their exchange, the host sync, the reordering); even - local what
moving the bytes costs. VDEV=1 (the default on GPUs) adds forward passes with NVSHMEM's all_to_all_vdev.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from trainer.moe import ExpertShard, grouped_mm  # noqa: E402


class Before(ExpertShard):
    """The exchange as it was before 2026-11-28 (indexing's own backward, a zero row always), the reference."""

    def exchange(self, rows, counts, compute):
        from torch.distributed.nn.functional import all_to_all_single

        counts = counts.to(torch.int64).view(self.world, self.local)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        send, recv = counts.sum(dim=1).tolist(), received.sum(dim=1).tolist()
        arrived = all_to_all_single(rows.new_empty(sum(recv), rows.shape[1]), rows, recv, send, group=self.group)
        expert_of_row = torch.repeat_interleave(
            torch.arange(self.local, device=rows.device).repeat(self.world), received.flatten())
        by_expert = torch.argsort(expert_of_row, stable=True)
        back = torch.empty_like(by_expert)
        back[by_expert] = torch.arange(by_expert.numel(), device=rows.device)
        padded = torch.cat([arrived[by_expert], arrived.new_zeros(1, arrived.shape[1])])
        local_counts = received.sum(dim=0) + torch.nn.functional.one_hot(
            torch.tensor(self.local - 1, device=received.device), self.local).to(received.dtype)
        out = compute(padded, local_counts)[:-1][back]
        return all_to_all_single(out.new_empty(rows.shape[0], out.shape[1]), out, send, recv, group=self.group)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    args = parser.parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else \
        torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.bfloat16
    local = args.experts // world
    torch.manual_seed(rank)
    up = [torch.randn(local, args.hidden, 2 * args.inter, device=device, dtype=dtype) * 0.02
          for _ in range(args.layers)]
    down = [torch.randn(local, args.inter, args.hidden, device=device, dtype=dtype) * 0.02
            for _ in range(args.layers)]
    shard, before = ExpertShard(rank, world, args.experts), Before(rank, world, args.experts)
    rows_n = args.tokens * args.top_k

    def experts(rows, counts, layer):
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = grouped_mm(rows, up[layer], offsets)
        gate, value = h.chunk(2, dim=-1)
        return grouped_mm(torch.nn.functional.silu(gate) * value, down[layer], offsets)

    def layer_input():
        return torch.bincount(torch.randint(0, args.experts, (rows_n,), device=device), minlength=args.experts)

    def step(mode: str, x: torch.Tensor, counts_per_layer) -> None:
        h = x
        for layer in range(args.layers):
            counts = counts_per_layer[layer]
            if mode in ("exchange", "before"):
                out = (shard if mode == "exchange" else before).exchange(h, counts, lambda rows, c, layer=layer: experts(rows, c, layer))
            elif mode in ("even", "counts sync", "permute"):
                from torch.distributed.nn.functional import all_to_all_single
                split = [rows_n // world] * world
                if mode == "counts sync":   # the split sizes' exchange and host read alone
                    c = counts.to(torch.int64).view(world, local)
                    received = torch.empty_like(c)
                    dist.all_to_all_single(received, c)
                    received.sum(dim=1).tolist()
                if mode == "permute":   # the received rows' reordering alone
                    order = torch.argsort(torch.repeat_interleave(
                        torch.arange(local, device=device).repeat(world), counts.view(world, local).flatten(),
                        output_size=rows_n), stable=True)
                    h = torch.cat([h[order], h.new_zeros(1, h.shape[1])])[:-1]
                arrived = all_to_all_single(h.new_empty(rows_n, h.shape[1]), h, split, split)
                even = torch.full((local,), rows_n // local, device=device, dtype=torch.int64)
                done = experts(arrived, even, layer)
                out = all_to_all_single(done.new_empty(rows_n, done.shape[1]), done, split, split)
            else:
                out = experts(h, torch.full((local,), rows_n // local, device=device, dtype=torch.int64), layer)
            h = h + out * 0.01
        h.float().pow(2).mean().backward()

    modes = ("before", "exchange", "counts sync", "permute", "even", "local")
    results = {m: [] for m in modes}
    counts_per_layer = [layer_input() for _ in range(args.layers)]
    for rep in range(3):
        for mode in modes:
            for i in range(args.steps + (3 if rep == 0 else 0)):
                x = torch.randn(rows_n, args.hidden, device=device, dtype=dtype, requires_grad=True)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dist.barrier()
                start = time.perf_counter()
                step(mode, x, counts_per_layer)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if not (rep == 0 and i < 3):
                    results[mode].append(time.perf_counter() - start)
    if rank == 0:
        base = sorted(results["local"])[len(results["local"]) // 2]
        print(f"{world} ranks, {args.layers} layers, {rows_n} rows of {args.hidden} per rank, "
              f"{local} experts per rank; median ms per step (forward + backward), against local:")
        for mode in modes:
            median = sorted(results[mode])[len(results[mode]) // 2]
            print(f"  {mode:10s} {median * 1000:8.1f} ms  {median / base:.3f}x")
    if device.type == "cuda" and os.environ.get("VDEV", "1") == "1":
        forward_only(args, rank, world, local, device, dtype, shard, experts, counts_per_layer, rows_n)
    dist.destroy_process_group()


@torch.no_grad()
def forward_only(args, rank, world, local, device, dtype, shard, experts, counts_per_layer, rows_n) -> None:
    """Forward passes only: the exchange with host-read split sizes, with even ones, and NVSHMEM's all_to_all_vdev
    (torch's symmetric memory: split sizes read on the device, no host sync)."""
    import torch.distributed._symmetric_memory as symm_mem

    group_name = dist.group.WORLD.group_name
    vdev = None
    try:
        symm_mem.set_backend("NVSHMEM")
        width = args.hidden
        inp = symm_mem.empty(rows_n * width, dtype=dtype, device=device)
        out = symm_mem.empty(world * rows_n * width, dtype=dtype, device=device)
        splits = symm_mem.empty(world, dtype=torch.int64, device=device)
        splits_offsets = symm_mem.empty((2, world), dtype=torch.int64, device=device)
        for buffer in (inp, out, splits, splits_offsets):
            symm_mem.rendezvous(buffer, group_name)

        def vdev(h, counts, layer):
            inp.view(rows_n, width).copy_(h)
            splits.copy_(counts.view(world, local).sum(dim=1) * width)
            torch.ops.symm_mem.all_to_all_vdev(inp, out, splits, splits_offsets, group_name)
            done = experts(out[:rows_n * width].view(rows_n, width), torch.full(
                (local,), rows_n // local, device=device, dtype=torch.int64), layer)
            inp.view(rows_n, width).copy_(done)
            splits.copy_(splits_offsets[0])
            torch.ops.symm_mem.all_to_all_vdev(inp, out, splits, splits_offsets, group_name)
            return out[:rows_n * width].view(rows_n, width)
    except Exception as exc:  # noqa: BLE001 - what this torch and node allow is the finding
        if rank == 0:
            print(f"all_to_all_vdev not run: {exc.__class__.__name__}: {str(exc)[:300]}")
    from torch.distributed.nn.functional import all_to_all_single

    def even(h, counts, layer):
        split = [rows_n // world] * world
        arrived = all_to_all_single(h.new_empty(rows_n, h.shape[1]), h, split, split)
        done = experts(arrived, torch.full((local,), rows_n // local, device=device, dtype=torch.int64), layer)
        return all_to_all_single(done.new_empty(rows_n, done.shape[1]), done, split, split)

    ways = {"exchange": lambda h, c, layer: shard.exchange(h, c, lambda r, cc: experts(r, cc, layer)),
            "even": even}
    if vdev is not None:
        ways["vdev"] = vdev
    times = {name: [] for name in ways}
    for rep in range(3):
        for name, way in ways.items():
            for i in range(args.steps + 2):
                h = torch.randn(rows_n, args.hidden, device=device, dtype=dtype)
                torch.cuda.synchronize()
                dist.barrier()
                start = time.perf_counter()
                for layer in range(args.layers):
                    h = h + way(h, counts_per_layer[layer], layer) * 0.01
                torch.cuda.synchronize()
                if i >= 2:
                    times[name].append(time.perf_counter() - start)
    if rank == 0:
        print("forward only, median ms per pass:", ", ".join(
            f"{name} {sorted(v)[len(v) // 2] * 1000:.1f}" for name, v in times.items()))


if __name__ == "__main__":
    main()
