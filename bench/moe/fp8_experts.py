"""The routed experts' frozen base in bf16 against FP8 (model.fp8_experts, trainer/fp8.py), one layer's experts
on one GPU: forward and input gradient of the gate_up and down projections on routed rows, both compiled as the
trainer compiles a layer, side by side in one run. Prints ms per layer, TFLOP/s, the ratio, and FP8's relative error
against bf16 (output and input gradient).

    python3 bench/moe/fp8_experts.py --shape qwen3-30b-a3b --tokens 8192
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from trainer import fp8, moe  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "glm-4.5-air": (128, 8, 4096, 1408)}  # experts, top-k, hidden, inter


class Experts(torch.nn.Module):
    def __init__(self, experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(experts, 2 * inter, hidden) * hidden ** -0.5,
                                               requires_grad=False)
        self.down_proj = torch.nn.Parameter(torch.randn(experts, hidden, inter) * inter ** -0.5,
                                            requires_grad=False)


def layer(experts: Experts, x: torch.Tensor, offsets: torch.Tensor, use_fp8: bool) -> torch.Tensor:
    def project(rows, name):
        if use_fp8:
            return fp8.grouped_mm(rows, experts, name, offsets)
        return moe.grouped_mm(rows, moe._base_weight(experts, name), offsets)

    gate, up = project(x, "gate_up_proj").chunk(2, dim=-1)
    return project(torch.nn.functional.silu(gate) * up, "down_proj")


def timed(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / repeats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args()
    why = fp8.supported(torch.device("cuda"))
    if why:
        sys.exit(why)
    n_experts, top_k, hidden, inter = SHAPES[args.shape]
    torch.manual_seed(0)
    device = torch.device("cuda")
    rows = args.tokens * top_k
    ids = torch.randint(0, n_experts, (rows,), device=device).sort().values
    offsets = torch.cumsum(torch.bincount(ids, minlength=n_experts), 0).to(torch.int32)
    bf16 = Experts(n_experts, hidden, inter).to(device, torch.bfloat16)
    wrapped = Experts(n_experts, hidden, inter).to(device, torch.bfloat16)
    wrapped.load_state_dict(bf16.state_dict())
    for name in ("gate_up_proj", "down_proj"):  # quantize_experts' conversion, on a bare module
        fp8.hold_in_fp8(wrapped, name, getattr(wrapped, name).detach())
    x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
    grad = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)

    def step(module, use_fp8):
        inp = x.detach().requires_grad_()
        out = layer(module, inp, offsets, use_fp8)
        out.backward(grad)
        return out, inp.grad

    results = {}
    flops = 2 * rows * hidden * 3 * inter * 2   # forward and input gradient of both projections
    for label, module, use_fp8 in (("bf16", bf16, False), ("fp8", wrapped, True)):
        compiled = torch.compile(lambda m=module, f=use_fp8: step(m, f))
        ms = timed(compiled, args.repeats)
        out, dx = compiled()
        results[label] = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1), "out": out.float(), "dx": dx.float()}
    base = results["bf16"]
    summary = {"shape": args.shape, "tokens": args.tokens, "rows": rows, "torch": torch.__version__}
    for label, r in results.items():
        err_out = ((r["out"] - base["out"]).norm() / base["out"].norm()).item()
        err_dx = ((r["dx"] - base["dx"]).norm() / base["dx"].norm()).item()
        summary[label] = {"ms_per_layer": r["ms"], "tflops": r["tflops"], "rel_err_out_vs_bf16": round(err_out, 4),
                          "rel_err_dx_vs_bf16": round(err_dx, 4)}
    summary["fp8_speedup"] = round(base["ms"] / results["fp8"]["ms"], 3)
    # the kernels alone, inputs already quantised: the gate_up product's forward
    w = bf16.gate_up_proj
    q, scale = fp8.quantize_rows(x)
    kernels = {"bf16 _grouped_mm": lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)}
    for fast in (False, True):
        kernels[f"fp8 _scaled_grouped_mm fast_accum={fast}"] = lambda fast=fast: torch._scaled_grouped_mm(
            q, wrapped.gate_up_proj_fp8.transpose(-2, -1), scale, wrapped.gate_up_proj_fp8_scale, offs=offsets,
            out_dtype=torch.bfloat16, use_fast_accum=fast)
    quantise = torch.compile(fp8.quantize_rows)
    kernels["quantise rows (compiled)"] = lambda: quantise(x)
    gate_up_flops = 2 * rows * hidden * 2 * inter
    summary["gate_up_forward_kernels"] = {
        label: {"ms": round(ms, 3), "tflops": round(gate_up_flops / ms / 1e9, 1)}
        for label, ms in ((label, timed(fn, args.repeats)) for label, fn in kernels.items())}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
