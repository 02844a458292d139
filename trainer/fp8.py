"""The routed experts' frozen base in FP8 (`model.fp8_experts`): e4m3 weights with one scale per output channel,
grouped GEMMs through torch's `_scaled_grouped_mm` (Hopper), the adapters and every gradient still bf16.

A frozen weight needs no weight gradient, so only two products touch it: the forward x @ W^T and the input
gradient dy @ W. Each wants the weight in its own layout with its own scales (the scales must run along the
dimension the product keeps), so each experts module keeps two e4m3 copies: W as stored, scaled per output row, and
W^T laid out row-major, scaled per input column. Both together take what the bf16 weight took, which is released.
The activations and the output gradients are quantised per row on the fly; the products accumulate in fp32 and
come out bf16.
"""
from __future__ import annotations

import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def supported(device: torch.device) -> str | None:
    """None where FP8 grouped GEMMs run here, else why not."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no _scaled_grouped_mm (torch >= 2.8 needed)"
    if device.type != "cuda":
        return "FP8 grouped GEMMs need a CUDA GPU"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return f"torch's FP8 grouped GEMM runs on Hopper (compute capability 9.0), this GPU is {major}.{minor}"
    return None


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., k) as e4m3 with one fp32 scale per row (x ~ q * scale), the row's largest value at e4m3's largest."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    q = (x.float() * (E4M3_MAX / amax)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, (amax / E4M3_MAX).squeeze(-1)


class _Fp8GroupedMM(torch.autograd.Function):
    """Rows offsets[e-1]:offsets[e] of x times W_e^T for a frozen stack W (experts, n, k), from its two e4m3
    copies: `w` (experts, n, k) with scales (experts, n), `wt` (experts, k, n) with scales (experts, k)."""

    @staticmethod
    def forward(ctx, x, w, w_scale, wt, wt_scale, offsets):
        ctx.save_for_backward(wt, wt_scale, offsets)
        q, scale = quantize_rows(x)
        return torch._scaled_grouped_mm(q, w.transpose(-2, -1), scale, w_scale, offs=offsets, out_dtype=x.dtype,
                                         use_fast_accum=True)

    @staticmethod
    def backward(ctx, grad):
        wt, wt_scale, offsets = ctx.saved_tensors
        q, scale = quantize_rows(grad.contiguous())
        dx = torch._scaled_grouped_mm(q, wt.transpose(-2, -1), scale, wt_scale, offs=offsets, out_dtype=grad.dtype,
                                       use_fast_accum=True)
        return dx, None, None, None, None, None


def grouped_mm(x: torch.Tensor, experts: nn.Module, name: str, offsets: torch.Tensor) -> torch.Tensor:
    """x's rows times the FP8 copies of experts' `name` (see moe.quantize_experts)."""
    return _Fp8GroupedMM.apply(x, *(getattr(experts, f"{name}_fp8{part}") for part in ("", "_scale", "_t", "_t_scale")),
                               offsets)


def has_fp8(experts: nn.Module, name: str) -> bool:
    return hasattr(experts, f"{name}_fp8")


def hold_in_fp8(experts: nn.Module, name: str, stored: torch.Tensor) -> None:
    """experts' frozen `name`, given as (experts, out, in), kept as its two e4m3 copies (buffers beside it, not in
    the state dict), and its bf16 storage released."""
    w, w_scale = quantize_rows(stored.contiguous())
    wt, wt_scale = quantize_rows(stored.transpose(-2, -1).contiguous())
    for part, value in (("", w), ("_scale", w_scale), ("_t", wt), ("_t_scale", wt_scale)):
        experts.register_buffer(f"{name}_fp8{part}", value, persistent=False)
    param = getattr(experts, name)
    param.data = param.data.new_zeros(1).expand(param.shape)
