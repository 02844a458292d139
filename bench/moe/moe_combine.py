"""Summing each token's routed copies back into one row (trainer/moe.py: _combine, and _Dispatch's gradient, which
is the same sum), one expert layer's worth on one GPU, side by side in one run:

- gather-then-sum: rows[restore].view(tokens, top_k, hidden).sum(1), compiled (the trainer's form until 2026-11-28);
- the trainer's form now: top_k gathered rows added up, compiled;
- a hand-written Triton kernel (one program per token and block of columns, the copies added in fp32): the
  reference for what the memory allows, forward only.

Each is timed with the residual add the model puts after it (forward), and through the trainer's autograd classes
as dispatch -> scale -> combine (forward and backward, where the gradient of dispatch is the same sum), and the
expert layout's partial sum (half the copies computed on this GPU) as placed-then-summed and as now. Prints ms
a call, the bytes moved over that time (GB/s), and the ratio to gather-then-sum; checks every form's values.

    python3 bench/moe/moe_combine.py --shape qwen3-30b-a3b --tokens 8192
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_experts import timed  # noqa: E402  (CUDA events over repeated calls, after three warm-ups)
from trainer import moe  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048), "glm-4.5-air": (128, 8, 4096)}  # experts, top-k, hidden


def gather_then_sum(rows, order, restore, top_k):
    return rows[restore].view(-1, top_k, rows.shape[-1]).sum(dim=1)


OldDispatch = moe._with_adjoint_gradient(moe._dispatch, gather_then_sum)
OldCombine = moe._with_adjoint_gradient(gather_then_sum, moe._dispatch)


@functools.cache
def _triton_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(rows_ptr, index_ptr, residual_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
        token = tl.program_id(0)
        columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = columns < hidden
        acc = tl.load(residual_ptr + token * hidden + columns, mask=mask).to(tl.float32)
        for copy in tl.static_range(TOP_K):
            row = tl.load(index_ptr + token * TOP_K + copy).to(tl.int64)
            acc += tl.load(rows_ptr + row * hidden + columns, mask=mask).to(tl.float32)
        tl.store(out_ptr + token * hidden + columns, acc.to(out_ptr.dtype.element_ty), mask=mask)

    return kernel


def triton_gather_sum(rows: torch.Tensor, index: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    tokens, top_k = index.shape
    hidden = rows.shape[1]
    out = torch.empty_like(residual)
    block = min(1024, 1 << (hidden - 1).bit_length())
    _triton_kernel()[(tokens, -(-hidden // block))](rows, index, residual, out, hidden, TOP_K=top_k, BLOCK=block,
                                                     num_warps=4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    n_experts, top_k, hidden = SHAPES[args.shape]
    torch.manual_seed(0)
    device = torch.device("cuda")
    tokens = args.tokens
    top_k_index = torch.rand(tokens, n_experts, device=device).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, device=device)
    expert_ids, order = torch.sort(top_k_index.reshape(-1))
    restore = torch.empty_like(order)
    restore[order] = torch.arange(order.numel(), device=device)
    routed = weights.reshape(-1)[order].unsqueeze(-1).to(torch.bfloat16)
    rows = torch.randn(tokens * top_k, hidden, device=device, dtype=torch.bfloat16)
    residual = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    grad = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    element = rows.element_size()
    forward_bytes = (tokens * top_k * hidden + 2 * tokens * hidden) * element  # copies and residual read, out written

    index = restore.view(tokens, top_k).contiguous()
    expected = (residual.float() + rows.float()[restore].view(tokens, top_k, hidden).sum(1)).to(torch.bfloat16)
    forms = {
        "gather-then-sum": torch.compile(lambda r, res: res + gather_then_sum(r, order, restore, top_k)),
        "trainer now": torch.compile(lambda r, res: res + moe._combine(r, order, restore, top_k)),
        "hand Triton kernel": lambda r, res: triton_gather_sum(r, index, res),
    }
    results = {"shape": args.shape, "tokens": tokens, "top_k": top_k, "hidden": hidden, "forward": {}, "layer": {}}
    for name, fn in forms.items():
        got = fn(rows, residual)
        error = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
        ms = timed(lambda: fn(rows, residual), args.repeats)
        results["forward"][name] = {"ms": ms, "GB/s": forward_bytes / ms / 1e6, "relative error": error}

    # the expert layout's sum over 2 GPUs: half the copies computed here, the others adding nothing
    copies = torch.randperm(tokens * top_k, device=device)[: tokens * top_k // 2].sort().values
    held = rows[: copies.numel()]

    def placed_then_summed(r):
        placed = r.new_zeros(tokens * top_k, hidden).index_copy_(0, copies, r)
        return placed.view(tokens, top_k, hidden).sum(dim=1)

    partial_expected = placed_then_summed(held)
    for name, fn in {"placed-then-summed": torch.compile(placed_then_summed),
                     "trainer now": torch.compile(lambda r: moe._sum_copies(r, copies, tokens, top_k))}.items():
        same = torch.allclose(fn(held).float(), partial_expected.float(), rtol=1e-2, atol=1e-2)
        results.setdefault("partial", {})[name] = {"ms": timed(lambda: fn(held), args.repeats), "matches": same}

    def layer(dispatch, combine):
        def step():
            inp = x.detach().requires_grad_()
            out = combine.apply(dispatch.apply(inp, order, restore, top_k) * routed, order, restore, top_k)
            out.backward(grad)
            return out, inp.grad
        return step

    reference_out, reference_grad = layer(OldDispatch, OldCombine)()
    for name, (dispatch, combine) in {"gather-then-sum": (OldDispatch, OldCombine),
                                      "trainer now": (moe._Dispatch, moe._Combine)}.items():
        step = torch.compile(layer(dispatch, combine))
        out, inp_grad = step()
        same = (torch.allclose(out.float(), reference_out.float(), rtol=2e-2, atol=2e-2)
                and torch.allclose(inp_grad.float(), reference_grad.float(), rtol=2e-2, atol=2e-2))
        results["layer"][name] = {"ms": timed(step, args.repeats), "matches": same}

    base_forward = results["forward"]["gather-then-sum"]["ms"]
    base_layer = results["layer"]["gather-then-sum"]["ms"]
    print(f"{args.shape}: {tokens} tokens x top {top_k}, hidden {hidden}, bf16; {forward_bytes / 1e6:.0f} MB a sum")
    print(f"{'form':<20} {'sum + residual (ms)':>19} {'GB/s':>7} {'vs gather-then-sum':>19} {'rel. error':>11}")
    for name, row in results["forward"].items():
        print(f"{name:<20} {row['ms']:>19.3f} {row['GB/s']:>7.0f} {base_forward / row['ms']:>18.2f}x "
              f"{row['relative error']:>11.1e}")
    print(f"{'form':<20} {'dispatch, scale, combine fwd+bwd (ms)':>38} {'vs gather-then-sum':>19} matches")
    for name, row in results["layer"].items():
        print(f"{name:<20} {row['ms']:>38.3f} {base_layer / row['ms']:>18.2f}x {row['matches']}")
    base_partial = results["partial"]["placed-then-summed"]["ms"]
    print(f"{'form':<20} {'half the copies summed (expert layout, 2 GPUs) (ms)':>52} {'ratio':>7} matches")
    for name, row in results["partial"].items():
        print(f"{name:<20} {row['ms']:>52.3f} {base_partial / row['ms']:>6.2f}x {row['matches']}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
