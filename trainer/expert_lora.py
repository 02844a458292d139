"""The routed experts' LoRA products as Triton kernels (CUDA): scale * (x @ A_e^T) @ B_e^T added to the frozen
base's output, on rows sorted by expert, and its gradients.

torch's grouped GEMM runs these skinny products (one side of rank r, 16 or 32) at about half the memory's speed:
each of the adapter's six products per projection is a launch with its own pass over the rows, and the rank-r
intermediate goes out to memory and back between them. Here each row tile of one expert does its whole forward
(both products and the base's addition) in one kernel, and its input gradient (G @ B_e, then @ A_e) in another;
the two weight gradients are per-expert sums over the expert's rows (one kernel, called twice). Nothing is read
more often than by torch's six products, and the rank-r intermediates stay on chip.

Layouts: x (rows, k) sorted by expert with offsets[e] the end of expert e's rows; a (experts, r, k), peft's
lora_A rows as stored; b (experts, r, n), as moe.expert_lora_b lays peft's lora_B out; base (rows, n).
The row tiles never straddle two experts: tile_ends[e] is the end of expert e's tiles, counted on the device
(tile_ends below), so nothing is read on the host.
"""
from __future__ import annotations

import inspect
import os

import torch
import triton
import triton.language as tl

TILE_M = 64  # rows per tile of the row-tile kernels (tile_ends is counted for it)


def tile_ends(counts: torch.Tensor) -> torch.Tensor:
    """The end of each expert's row tiles (int32), counted from its rows, on the device."""
    return torch.cumsum((counts.to(torch.int32) + TILE_M - 1) // TILE_M, dim=0, dtype=torch.int32)


@triton.jit
def _find_tile(tile_ends_ptr, offsets_ptr, experts, EXPERTS_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, first row, end of the expert's rows) of this program's row tile; expert == experts past the last."""
    pid = tl.program_id(0)
    index = tl.arange(0, EXPERTS_POW2)
    ends = tl.load(tile_ends_ptr + index, mask=index < experts, other=2147483647)
    expert = tl.sum((ends <= pid).to(tl.int32))
    inside = expert < experts
    tile_start = tl.load(tile_ends_ptr + expert - 1, mask=inside & (expert > 0), other=0)
    row_start = tl.load(offsets_ptr + expert - 1, mask=inside & (expert > 0), other=0)
    row_end = tl.load(offsets_ptr + expert, mask=inside, other=0)
    return expert, row_start + (pid - tile_start) * BLOCK_M, row_end


def _configs(configs: list) -> list:
    """configs for autotune; Triton's interpreter (TRITON_INTERPRET=1, no GPU: the unit tests) takes the first,
    since it has nothing to time them on."""
    return configs[:1] if os.environ.get("TRITON_INTERPRET") == "1" else configs


# Triton >= 3.2 keeps each kernel's autotuning result in its cache folder (TRITON_CACHE_DIR, ~/.triton/cache), so a
# later attempt or resume on the node skips timing every config again (tens of seconds before the first step).
_KEEP_TUNING = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}


def _tile_configs():
    return _configs([triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
                     for n in (64, 128) for k in (64, 128) for w in (4, 8) for s in (2, 3)])


@triton.autotune(configs=_tile_configs(), key=["K", "N", "rank", "BLOCK_M"], **_KEEP_TUNING)
@triton.jit
def _forward_kernel(x_ptr, a_ptr, b_ptr, base_ptr, out_ptr, h_ptr, offsets_ptr, tile_ends_ptr, scale, experts,
                    K, N, rank, RANK: tl.constexpr, PRECISION: tl.constexpr, EXPERTS_POW2: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    expert, first, end = _find_tile(tile_ends_ptr, offsets_ptr, experts, EXPERTS_POW2, BLOCK_M)
    if expert >= experts:
        return
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    ranks = tl.arange(0, RANK)
    rank_ok = ranks < rank
    cols = tl.arange(0, BLOCK_K)
    a_expert = a_ptr + expert.to(tl.int64) * rank * K
    acc = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        at = k + cols
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + at[None, :], mask=row_ok[:, None] & (at[None, :] < K),
                    other=0.0)
        a = tl.load(a_expert + ranks[None, :] * K + at[:, None], mask=rank_ok[None, :] & (at[:, None] < K), other=0.0)
        acc = tl.dot(x, a, acc, input_precision=PRECISION)
    h = (acc * scale).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + rows[:, None].to(tl.int64) * rank + ranks[None, :], h, mask=row_ok[:, None] & rank_ok[None, :])
    outs = tl.arange(0, BLOCK_N)
    b_expert = b_ptr + expert.to(tl.int64) * rank * N
    for n in range(0, N, BLOCK_N):
        at = n + outs
        ok = row_ok[:, None] & (at[None, :] < N)
        b = tl.load(b_expert + ranks[:, None] * N + at[None, :], mask=rank_ok[:, None] & (at[None, :] < N), other=0.0)
        where = rows[:, None].to(tl.int64) * N + at[None, :]
        y = tl.dot(h, b, input_precision=PRECISION) + tl.load(base_ptr + where, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + where, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.autotune(configs=_tile_configs(), key=["K", "N", "rank", "BLOCK_M"], **_KEEP_TUNING)
@triton.jit
def _input_grad_kernel(g_ptr, a_ptr, b_ptr, du_ptr, dx_ptr, offsets_ptr, tile_ends_ptr, scale, experts,
                       K, N, rank, RANK: tl.constexpr, PRECISION: tl.constexpr, EXPERTS_POW2: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    expert, first, end = _find_tile(tile_ends_ptr, offsets_ptr, experts, EXPERTS_POW2, BLOCK_M)
    if expert >= experts:
        return
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    ranks = tl.arange(0, RANK)
    rank_ok = ranks < rank
    outs = tl.arange(0, BLOCK_N)
    b_expert = b_ptr + expert.to(tl.int64) * rank * N
    acc = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
    for n in range(0, N, BLOCK_N):
        at = n + outs
        g = tl.load(g_ptr + rows[:, None].to(tl.int64) * N + at[None, :], mask=row_ok[:, None] & (at[None, :] < N),
                    other=0.0)
        b = tl.load(b_expert + ranks[None, :] * N + at[:, None], mask=rank_ok[None, :] & (at[:, None] < N), other=0.0)
        acc = tl.dot(g, b, acc, input_precision=PRECISION)
    du = (acc * scale).to(du_ptr.dtype.element_ty)
    tl.store(du_ptr + rows[:, None].to(tl.int64) * rank + ranks[None, :], du, mask=row_ok[:, None] & rank_ok[None, :])
    cols = tl.arange(0, BLOCK_K)
    a_expert = a_ptr + expert.to(tl.int64) * rank * K
    for k in range(0, K, BLOCK_K):
        at = k + cols
        a = tl.load(a_expert + ranks[:, None] * K + at[None, :], mask=rank_ok[:, None] & (at[None, :] < K), other=0.0)
        ok = row_ok[:, None] & (at[None, :] < K)
        dx = tl.dot(du, a, input_precision=PRECISION).to(dx_ptr.dtype.element_ty)
        tl.store(dx_ptr + rows[:, None].to(tl.int64) * K + at[None, :], dx, mask=ok)


@triton.autotune(configs=_configs([triton.Config({"BLOCK_M": m, "BLOCK_C": c}, num_warps=w, num_stages=s)
                                   for m in (64, 128) for c in (64, 128, 256) for w in (4, 8) for s in (2, 3)]),
                 key=["C", "rank"], **_KEEP_TUNING)
@triton.jit
def _expert_sums_kernel(lhs_ptr, rhs_ptr, out_ptr, offsets_ptr, C, rank, RANK: tl.constexpr, PRECISION: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """out[e] = lhs[rows of e]^T @ rhs[rows of e]: lhs (rows, rank), rhs (rows, C), out (experts, rank, C)."""
    expert = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    start = tl.load(offsets_ptr + expert - 1, mask=expert > 0, other=0)
    end = tl.load(offsets_ptr + expert)
    ranks = tl.arange(0, RANK)
    rank_ok = ranks < rank
    acc = tl.zeros((RANK, BLOCK_C), dtype=tl.float32)
    for first in range(start, end, BLOCK_M):
        rows = first + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        lhs = tl.load(lhs_ptr + ranks[:, None] + rows[None, :].to(tl.int64) * rank,
                      mask=rank_ok[:, None] & row_ok[None, :], other=0.0)
        rhs = tl.load(rhs_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                      other=0.0)
        acc = tl.dot(lhs, rhs, acc, input_precision=PRECISION)
    tl.store(out_ptr + expert.to(tl.int64) * rank * C + ranks[:, None] * C + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=rank_ok[:, None] & col_ok[None, :])


def _rank_block(rank: int) -> int:
    """The rank dimension as the kernels hold it: a power of two, at least 16 (tl.dot's least), the rest masked."""
    return max(16, triton.next_power_of_2(rank))


def _precision(x: torch.Tensor) -> str:
    """tl.dot's precision: float32 inputs multiplied as float32 (Triton would take TF32), as torch's matmul does."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _tiles(rows: int, experts: int) -> tuple[int]:
    """The row-tile kernels' grid: enough programs for every expert's last tile being partial."""
    return (triton.cdiv(rows, TILE_M) + experts,)


@torch.library.custom_op("nodectl::expert_lora", mutates_args=())
def expert_lora(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, base: torch.Tensor, offsets: torch.Tensor,
                ends: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(base + scale * (x @ A_e^T) @ B_e^T row by row, the scaled rank-r intermediate h)."""
    experts, rank, k = a.shape
    n = b.shape[-1]
    out = torch.empty_like(base)
    h = x.new_empty(x.shape[0], rank)
    if x.shape[0]:
        _forward_kernel[_tiles(x.shape[0], experts)](
            x, a, b, base, out, h, offsets, ends, scale, experts, k, n, rank, RANK=_rank_block(rank),
            PRECISION=_precision(x), EXPERTS_POW2=triton.next_power_of_2(experts), BLOCK_M=TILE_M)
    return out, h


@expert_lora.register_fake
def _(x, a, b, base, offsets, ends, scale):
    return torch.empty_like(base), x.new_empty(x.shape[0], a.shape[1])


@torch.library.custom_op("nodectl::expert_lora_backward", mutates_args=())
def expert_lora_backward(grad: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, h: torch.Tensor,
                         offsets: torch.Tensor, ends: torch.Tensor,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dA, dB) of expert_lora's output for its gradient `grad` (rows, n)."""
    experts, rank, k = a.shape
    n = b.shape[-1]
    rows = x.shape[0]
    dx = torch.empty_like(x)
    du = x.new_empty(rows, rank)
    da = torch.zeros_like(a) if not rows else torch.empty_like(a)
    db = torch.zeros_like(b) if not rows else torch.empty_like(b)
    if rows:
        _input_grad_kernel[_tiles(rows, experts)](
            grad, a, b, du, dx, offsets, ends, scale, experts, k, n, rank, RANK=_rank_block(rank),
            PRECISION=_precision(x), EXPERTS_POW2=triton.next_power_of_2(experts), BLOCK_M=TILE_M)
        for lhs, rhs, out, width in ((du, x, da, k), (h, grad, db, n)):
            _expert_sums_kernel[lambda meta, width=width: (experts, triton.cdiv(width, meta["BLOCK_C"]))](
                lhs, rhs, out, offsets, width, rank, RANK=_rank_block(rank), PRECISION=_precision(x))
    return dx, da, db


@expert_lora_backward.register_fake
def _(grad, x, a, b, h, offsets, ends, scale):
    return torch.empty_like(x), torch.empty_like(a), torch.empty_like(b)


def _setup(ctx, inputs, output):
    x, a, b, _, offsets, ends, scale = inputs
    ctx.save_for_backward(x, a, b, output[1], offsets, ends)
    ctx.scale = scale


def _backward(ctx, grad, _grad_h):
    x, a, b, h, offsets, ends = ctx.saved_tensors
    dx, da, db = expert_lora_backward(grad.contiguous(), x, a, b, h, offsets, ends, ctx.scale)
    return dx, da, db, grad, None, None, None


expert_lora.register_autograd(_backward, setup_context=_setup)


def add_lora(base: torch.Tensor, x: torch.Tensor, down: torch.Tensor, up: torch.Tensor, scale: float,
             offsets: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """base + scale * (x @ down_e) @ up_e for moe's factors: down (experts, k, r), a transposed view of peft's
    lora_A rows; up (experts, r, n)."""
    out, _ = expert_lora(x.contiguous(), down.transpose(1, 2).contiguous(), up.contiguous(), base.contiguous(),
                         offsets, ends, float(scale))
    return out
