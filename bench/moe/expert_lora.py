"""The routed experts' LoRA products, torch's grouped GEMMs against nodectl's Triton kernels
(model.expert_lora_kernel: torch | triton; trainer/expert_lora.py), one layer's gate_up and down projections on
one GPU: forward and backward (input, A and B gradients) of base + scale * (x @ A_e^T) @ B_e^T on routed rows, both
compiled as the trainer compiles a layer, side by side in one run. Prints each one's GPU time per layer (the sum of
its kernels by torch's profiler, each kernel listed) and the ratio, the speed that makes of the bytes they must
move at least, the wall time per call (which adds the host's launches), and the errors against a float64
reference.

    python3 bench/moe/expert_lora.py --shape qwen3-30b-a3b --tokens 8192
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_experts import SHAPES, timed  # noqa: E402  (experts, top-k, hidden, inter; CUDA-event timing)

from trainer import expert_lora, moe  # noqa: E402


def routed_counts(tokens: int, experts: int, top_k: int, device) -> torch.Tensor:
    """Rows per expert of `tokens` tokens each routed to top_k distinct experts at random."""
    picks = torch.rand(tokens, experts, device=device).topk(top_k, dim=-1).indices
    return torch.bincount(picks.flatten(), minlength=experts)


def looped(base, x, down, up, scale, offsets, ends):
    """The reference: expert by expert (float64 here)."""
    pieces, start = [], 0
    for expert, stop in enumerate(offsets.tolist()):
        pieces.append(base[start:stop] + scale * (x[start:stop] @ down[expert]) @ up[expert])
        start = stop
    return torch.cat(pieces)


def with_torch(base, x, down, up, scale, offsets, ends):
    return base + moe.grouped_mm(moe.grouped_mm(x, down, offsets) * scale, up, offsets)


def with_triton(base, x, down, up, scale, offsets, ends):
    return expert_lora.add_lora(base, x, down, up, scale, offsets, ends)


def problem(rows: int, k: int, n: int, rank: int, experts: int, counts, device):
    torch.manual_seed(rank)
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    a = torch.randn(experts * rank, k, device=device) * k ** -0.5        # peft's lora_A, fp32 as trained
    b = torch.randn(n, rank * experts, device=device) * rank ** -0.5  # peft's lora_B (out, r * experts)
    base = torch.randn(rows, n, device=device, dtype=torch.bfloat16)
    grad = torch.randn(rows, n, device=device, dtype=torch.bfloat16)
    return x, a, b, base, grad


def step(fn, x, a, b, base, grad, offsets, ends, experts, scale):
    """One forward and backward as the trainer runs it: factors cast and laid out from peft's fp32 weights, the
    gradients of x, A and B (the base's output gradient is the incoming one, nothing to compute)."""
    x, a, b = (t.detach().requires_grad_() for t in (x, a, b))
    down = a.to(x.dtype).view(experts, -1, a.shape[1]).transpose(1, 2)
    up = moe.expert_lora_b(b.to(x.dtype), experts)
    out = fn(base, x, down, up, scale, offsets, ends)
    out.backward(grad)
    return out.detach(), x.grad, a.grad, b.grad


def kernels(fn, repeats: int = 5) -> dict[str, float]:
    """The GPU time per call (us) of each kernel `fn` runs (by torch's profiler; a name shortened to 80 characters,
    the kernels that share it added up), longest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total > 0:
            times[event.name[:80]] = times.get(event.name[:80], 0.0) + event.device_time_total / repeats
    return dict(sorted(times.items(), key=lambda item: -item[1]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rank", type=int, default=16, help="the recipe's expert r (gate_up's adapter has twice)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tiles", default="", help="rows per tile of the Triton kernels to try besides "
                        "expert_lora.TILE_M, e.g. 32,128")
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda")
    experts, top_k, hidden, inter = SHAPES[args.shape]
    counts = routed_counts(args.tokens, experts, top_k, device)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    rows = args.tokens * top_k
    report = {"shape": args.shape, "tokens": args.tokens, "rows": rows, "projections": []}
    compiled = {name: torch.compile(fn) for name, fn in (("torch", with_torch), ("triton", with_triton))}
    tiles = {"torch": expert_lora.TILE_M, "triton": expert_lora.TILE_M}
    for tile in filter(None, args.tiles.split(",")):
        compiled[f"triton-{tile}"], tiles[f"triton-{tile}"] = compiled["triton"], int(tile)
    total = dict.fromkeys(compiled, 0.0)
    for name, k, n, rank in (("gate_up", hidden, 2 * inter, 2 * args.rank), ("down", inter, hidden, args.rank)):
        x, a, b, base, grad = problem(rows, k, n, rank, experts, counts, device)
        scale = 2.0
        ref = [t.double() for t in step(looped, x.double(), a.double(), b.double(), base.double(), grad.double(),
                                        offsets, None, experts, scale)]
        row = {"projection": name, "k": k, "n": n, "r": rank}
        # least bytes: forward reads x and base and writes out; backward reads the gradient (twice: once per
        # product it feeds) and x, and writes dx
        least = 2 * rows * (k + 2 * n + 2 * n + 2 * k)
        for kernel, fn in compiled.items():
            expert_lora.TILE_M = tiles[kernel]
            ends = expert_lora.tile_ends(counts)
            got = step(fn, x, a, b, base, grad, offsets, ends, experts, scale)
            errors = {part: float((g.double() - r).norm() / r.norm()) for part, g, r in
                      zip(("out", "dx", "dA", "dB"), got, ref)}
            wall = timed(lambda: step(fn, x, a, b, base, grad, offsets, ends, experts, scale), args.repeats)
            times = kernels(lambda: step(fn, x, a, b, base, grad, offsets, ends, experts, scale))
            ms = sum(times.values()) / 1000
            total[kernel] += ms
            row[kernel] = {"GPU ms": round(ms, 3), "wall ms": round(wall, 3),
                           "TB/s at the least bytes": round(least / ms / 1e9, 2),
                           "kernels (us)": {n: round(us, 1) for n, us in times.items()},
                           "relative error": {p: f"{e:.1e}" for p, e in errors.items()}}
            print(f"{name:8} {kernel:10} GPU {ms:6.3f} ms ({least / ms / 1e9:4.2f} TB/s at the least bytes), wall "
                  f"{wall:6.3f} ms; errors " + " ".join(f"{p} {e:.1e}" for p, e in errors.items()), flush=True)
            for kernel_name, us in times.items():
                print(f"      {us:8.1f} us  {kernel_name}")
        row["triton vs torch"] = round(row["torch"]["GPU ms"] / row["triton"]["GPU ms"], 3)
        expert_lora.TILE_M = tiles["triton"]
        report["projections"].append(row)
    report["layer ms"] = {k: round(v, 3) for k, v in total.items()}
    report["speed-up"] = round(total["torch"] / total["triton"], 3)
    print(f"one layer's adapter products, forward + backward, GPU time: torch {total['torch']:.3f} ms, triton "
          f"{total['triton']:.3f} ms: {report['speed-up']}x"
          + "".join(f"; {k} {v:.3f} ms" for k, v in total.items() if k not in ("torch", "triton")), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
