"""Routed-expert LoRA computed on the routed tokens: the grouped path (`model.moe_kernel: grouped`).

peft adapts a fused expert weight (`mlp.experts.gate_up_proj`, experts first) through `ParamWrapper`, which
parametrises the weight as W + scale * B @ A for the whole expert stack on every forward (and again on every
recomputation), and whose backward forms a gradient the size of that stack. The grouped path never forms B @ A:
the tokens are sorted by expert once per layer, and each projection is one grouped GEMM for the frozen base
(x @ W_e^T) plus two for the adapter on the same rows, scale * (x @ A_e^T) @ B_e^T, the "split LoRA" product.

The adapter stays peft's: the same modules, parameter names and shapes (`lora_A` is (experts * r, in),
`lora_B` is (out, r * experts), expert e's rank-r factors at rows e*r.. of A and columns r_i * experts + e of B, as
`ParamWrapper.get_delta_weight` reads them), so saving, `PeftModel.from_pretrained`, the merged and the vLLM
exports are untouched. Only the outermost wrapper of each experts module changes: its class becomes a
ParamWrapper subclass whose forward is the grouped path; anything that path does not cover (merged or disabled
adapters, several active adapters, expert-parallel sentinels) runs peft's own forward.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from . import fp8

PROJECTIONS = ("gate_up_proj", "up_proj", "down_proj")


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows offsets[e-1]:offsets[e] of x times weight[e] (experts, k, n), for every expert e: transformers'
    dispatcher (torch's grouped GEMM where this torch and device have one, its own autograd op elsewhere), or a
    loop over experts with a transformers that has none."""
    try:
        from transformers.integrations.moe import _grouped_mm
    except ImportError:
        _grouped_mm = None
    if _grouped_mm is not None:
        return _grouped_mm(x, weight, offs=offsets)
    pieces, start = [], 0
    for expert, stop in enumerate(offsets.tolist()):
        pieces.append(x[start:stop] @ weight[expert].to(x.dtype))
        start = stop
    return torch.cat(pieces) if pieces else x.new_empty(0, weight.shape[-1])


def _base_weight(experts: nn.Module, name: str) -> torch.Tensor:
    """The frozen stack as (experts, in, out) for x @ W; a transposed view where it is stored (experts, out, in)."""
    weight = getattr(experts, name)
    return weight if getattr(experts, "is_transposed", False) else weight.transpose(-2, -1)


@torch.library.custom_op("nodectl::expert_lora_b", mutates_args=())
def expert_lora_b(b: torch.Tensor, experts: int) -> torch.Tensor:
    """peft's lora_B of an expert stack, (out, r * experts) with the expert innermost, as (experts, r, out)
    rows for a grouped GEMM. A copy (out * r * experts values, small) that no view can replace: no dimension of
    the permuted view has unit stride. An opaque op, so that a compiler keeps the layout the GEMM needs."""
    out, width = b.shape
    return b.view(out, width // experts, experts).permute(2, 1, 0).contiguous()


@expert_lora_b.register_fake
def _expert_lora_b_fake(b: torch.Tensor, experts: int) -> torch.Tensor:
    return b.new_empty(experts, b.shape[1] // experts, b.shape[0])


def _expert_lora_b_backward(ctx, grad: torch.Tensor):
    experts, rank, out = grad.shape
    return grad.permute(2, 1, 0).reshape(out, rank * experts), None


expert_lora_b.register_autograd(_expert_lora_b_backward)


def lora_factors(wrapper: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """(A as (experts, in, r), B as (experts, r, out), scale) of the wrapper's active adapter, or None when it has
    none. A is a transposed view (a layout grouped GEMMs take as it is); B is laid out again (expert_lora_b)."""
    if wrapper.disable_adapters:
        return None
    name = wrapper.active_adapters[0]
    if name not in wrapper.lora_A:
        return None
    experts = wrapper.num_experts
    a = wrapper.lora_A[name].weight
    b = wrapper.lora_B[name].weight
    down = a.to(dtype).view(experts, a.shape[0] // experts, a.shape[1]).transpose(1, 2)
    return down, expert_lora_b(b.to(dtype), experts), wrapper.scaling[name]


def _dispatch(x: torch.Tensor, order: torch.Tensor, restore: torch.Tensor, top_k: int) -> torch.Tensor:
    """(tokens, d) -> (tokens * top_k, d): row i is token order[i] // top_k (each token once per expert it goes
    to, sorted by expert)."""
    return x[order // top_k]


def _combine(rows: torch.Tensor, order: torch.Tensor, restore: torch.Tensor, top_k: int) -> torch.Tensor:
    """The adjoint of _dispatch: each token's top_k rows summed back into one. `restore` inverts `order`."""
    if torch.compiler.is_compiling():
        return _added_up(rows, restore.view(-1, top_k))
    return rows[restore].view(-1, top_k, rows.shape[-1]).sum(dim=1)


def _added_up(rows: torch.Tensor, index: torch.Tensor, some_missing: bool = False) -> torch.Tensor:
    """Row t: rows[index[t, 0]] + rows[index[t, 1]] + ..., for compiled code; with some_missing, an index of
    len(rows) adds nothing. Spelt as gathered rows added up, which the compiler makes one pointwise kernel reading
    along each row. Gathering then summing compiles to a reduction over each token's copies, which ran at a quarter
    of the speed on an H200 (Qwen3-30B-A3B's width, 65,536 tokens x top 8, with the residual add: 2.55 ms against
    0.61, a hand-written Triton kernel's 0.60; bench/moe/moe_combine.py). The mask costs: only where rows go missing."""
    out = None
    for copy in range(index.shape[1]):
        at = index[:, copy]
        if some_missing:
            row = torch.where((at < rows.shape[0]).unsqueeze(-1), rows[at.clamp(max=rows.shape[0] - 1)], 0)
        else:
            row = rows[at]
        out = row if out is None else out + row
    return out


_SAVED = object()   # in place of a tensor argument that the autograd context saved


def _with_adjoint_gradient(function, adjoint) -> type:
    """An autograd function computing `function(x, *args)`, whose gradient is `adjoint(grad, *args)`: dispatch and
    combine are each other's adjoints, so both backward passes are gathers and a sum (indexing's own backward
    would be a sort-based scatter-add); so are gathering every rank's rows and summing them back to their rank."""

    class WithAdjoint(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, *args):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            ctx.save_for_backward(*tensors)
            ctx.rest = [_SAVED if isinstance(a, torch.Tensor) else a for a in args]
            return function(x, *args)

        @staticmethod
        def backward(ctx, grad):
            saved = iter(ctx.saved_tensors)
            args = [next(saved) if a is _SAVED else a for a in ctx.rest]
            return (adjoint(grad, *args), *[None] * len(args))

    WithAdjoint.__name__ = WithAdjoint.__qualname__ = f"{function.__name__.strip('_').title()}"
    return WithAdjoint


_Dispatch = _with_adjoint_gradient(_dispatch, _combine)
_Combine = _with_adjoint_gradient(_combine, _dispatch)


def _permute(x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, _: int) -> torch.Tensor:
    """x's rows in `order`; `inverse` puts them back."""
    return x[order]


def _unpermute(x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, _: int) -> torch.Tensor:
    return x[inverse]


# A permutation of rows whose gradient is the inverse permutation, a gather: indexing's own backward is an
# accumulating scatter, which on 2 H200s took 24 of the 62 ms an expert layout's exchanges added to a step
# (bench/moe/moe_exchange.py).
_Permute = _with_adjoint_gradient(_permute, _unpermute)


def _pick(x: torch.Tensor, copies: torch.Tensor, tokens: int, top_k: int) -> torch.Tensor:
    """Row i is the token of routed copy copies[i] (copy c: token c // top_k, its (c % top_k)-th expert)."""
    return x.index_select(0, copies // top_k)


def _sum_copies(rows: torch.Tensor, copies: torch.Tensor, tokens: int, top_k: int) -> torch.Tensor:
    """The adjoint of _pick: each of `tokens` the sum of its copies' rows (row i is copy copies[i]; copies not
    listed are zero). The rows are put in place and summed: no atomic accumulation (a copy appears once), which
    as index_add took 11% of an expert layout's GPU time on 2 H200s. Compiled, each copy's row is gathered
    instead (_added_up): no zero-filled buffer of every copy, 9.5x faster on an H200 (bench/moe/moe_combine.py)."""
    if torch.compiler.is_compiling():
        slot = torch.full((tokens * top_k,), rows.shape[0], dtype=copies.dtype, device=copies.device)
        slot = slot.index_copy(0, copies, torch.arange(copies.numel(), dtype=copies.dtype, device=copies.device))
        return _added_up(rows, slot.view(tokens, top_k), some_missing=True)
    placed = rows.new_zeros(tokens * top_k, rows.shape[-1]).index_copy_(0, copies, rows)
    return placed.view(tokens, top_k, rows.shape[-1]).sum(dim=1)


_Pick = _with_adjoint_gradient(_pick, _sum_copies)
_SumCopies = _with_adjoint_gradient(_sum_copies, _pick)


def _gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's x of the group, concatenated in rank order (the same shape on every rank)."""
    import torch.distributed as dist

    x = x.contiguous()
    out = x.new_empty(dist.get_world_size(group) * x.shape[0], *x.shape[1:])
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x, group=group)
    return out


def _sum_rows_back(x: torch.Tensor, group) -> torch.Tensor:
    """The adjoint of _gather_rows: the group's x summed, and this rank's share of the rows kept."""
    import torch.distributed as dist

    x = x.contiguous()
    out = x.new_empty(x.shape[0] // dist.get_world_size(group), *x.shape[1:])
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, x, group=group)
    return out


_GatherRows = _with_adjoint_gradient(_gather_rows, _sum_rows_back)
_SumRowsBack = _with_adjoint_gradient(_sum_rows_back, _gather_rows)


def triton_kernels_here() -> str | None:
    """None where the adapter's Triton kernels (trainer/expert_lora.py) can run on this machine's GPUs, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    return None


def lora_kernel(setting: str) -> str:
    """model.expert_lora_kernel as it runs: auto is torch's grouped GEMMs, on every device. Measured A B B A in the
    trainer (Qwen3-30B-A3B cut to 16 layers, compiled, one H100, two rounds on 2026-12-06), torch's products ran
    1.021x and 1.022x as fast as the Triton kernels, every run of one above every run of the other: the kernels,
    1.66x faster alone, lose to what torch.compile fuses around torch's. `triton` still runs them (CUDA ranks
    only, checked at start)."""
    return "torch" if setting == "auto" else setting


def _project(x: torch.Tensor, experts: nn.Module, name: str, lora, offsets: torch.Tensor,
             ends: torch.Tensor | None) -> torch.Tensor:
    """x's rows through the projection `name` of their experts, adapter included; `ends` (the row tiles'
    ends, expert_lora.tile_ends) where the adapter runs in the Triton kernels, else None."""
    if fp8.has_fp8(experts, name):
        out = fp8.grouped_mm(x, experts, name, offsets)
    else:
        out = grouped_mm(x, _base_weight(experts, name), offsets)
    if lora is None:
        return out
    down, up, scale = lora
    if ends is not None:
        from . import expert_lora

        return expert_lora.add_lora(out, x, down, up, scale, offsets, ends)
    return out + grouped_mm(grouped_mm(x, down, offsets) * scale, up, offsets)


def grouped_forward(experts: nn.Module, adapters: dict[str, tuple | None], hidden_states: torch.Tensor,
                    top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts module's output for (tokens, hidden) inputs routed to top_k_index with top_k_weights, the
    base and the adapters of every projection computed on the same expert-sorted rows. The routing is
    transformers' grouped_mm experts forward, except that each row's routing weight scales the expert's
    intermediate (a third of the width of its output) before the down projection, which is linear: the same
    product, one full-width pass and one saved full-width tensor fewer. With expert parallelism the rows travel
    to the ranks that hold their experts and back (ExpertShard)."""
    top_k = top_k_index.shape[-1]
    shard = getattr(experts, "expert_shard", None)
    if shard is not None and shard.gathers(top_k):
        local = {k: v and shard.local_factors(v) for k, v in adapters.items()}
        return shard.gathered(hidden_states, top_k_index, top_k_weights, lambda rows, counts, weights:
                              _experts_on_rows(experts, local, rows, counts, weights)).to(hidden_states.dtype)
    expert_ids, order = torch.sort(top_k_index.reshape(-1))
    restore = torch.empty_like(order)
    restore[order] = torch.arange(order.numel(), device=order.device)
    rows = _Dispatch.apply(hidden_states, order, restore, top_k)
    weights = top_k_weights.reshape(-1)[order]
    counts = _counts(expert_ids, experts.num_experts)
    if shard is None:
        out = _experts_on_rows(experts, adapters, rows, counts, weights)
    else:
        out = shard.exchange(rows, counts, lambda local, local_counts: _experts_on_rows(
            experts, {k: v and shard.local_factors(v) for k, v in adapters.items()}, local, local_counts, None))
        out = out * weights.unsqueeze(-1).to(out.dtype)
    return _Combine.apply(out, order, restore, top_k).to(hidden_states.dtype)


def _counts(ids: torch.Tensor, bins: int) -> torch.Tensor:
    """How many of `ids` are 0, 1, .. bins - 1: histc rather than bincount, no host sync, as transformers does
    (it takes float input on CPU)."""
    return torch.histc(ids.float() if ids.device.type == "cpu" else ids.int(), bins=bins, min=0, max=bins - 1)


def _experts_on_rows(experts: nn.Module, adapters: dict, rows: torch.Tensor, counts: torch.Tensor,
                     weights: torch.Tensor | None) -> torch.Tensor:
    """Every expert of this module (or of this rank's shard) on its rows, which come sorted by expert with
    counts[e] rows for expert e; the routing weights applied where the down projection allows (or by the
    caller, weights None)."""
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    ends = None
    if any(adapters.values()) and getattr(experts, "lora_kernel", "torch") == "triton":
        from . import expert_lora

        ends = expert_lora.tile_ends(counts)
    gated = getattr(experts, "has_gate", True)
    first = "gate_up_proj" if gated else "up_proj"
    out = _project(rows, experts, first, adapters.get(first), offsets, ends)
    out = experts._apply_gate(out) if gated else experts.act_fn(out)
    inside = weights is not None and not getattr(experts, "has_post_expert_norm", False)
    if inside:  # down_proj is linear (no norm after it): scale its narrower input
        out = out * weights.unsqueeze(-1).to(out.dtype)
    out = _project(out, experts, "down_proj", adapters.get("down_proj"), offsets, ends)
    if getattr(experts, "has_post_expert_norm", False):
        out = experts.post_expert_norm(out)
    if weights is not None and not inside:
        out = out * weights.unsqueeze(-1)
    return out


# The gathered exchange's collectives run outside torch.compile's graphs (each is one NCCL call on the GPU's
# stream that the host does not wait for), where the traffic count of a step sees them.
@torch.compiler.disable
def _gather_routing(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, group):
    return (_GatherRows.apply(hidden, group), _gather_rows(top_k_index, group),
            _GatherRows.apply(top_k_weights, group))


@torch.compiler.disable
def _sum_back(partial: torch.Tensor, group) -> torch.Tensor:
    return _SumRowsBack.apply(partial, group)


def _functional_collectives():
    """(all-gather with its gradient, reduce-scatter with its gradient, all-gather): torch's functional
    collectives, which torch.compile traces into a graph (named *_single_* from torch 2.10, *_tensor_* before)."""
    import torch.distributed._functional_collectives as fc

    return (getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd,
            getattr(fc, "reduce_scatter_single_autograd", None) or fc.reduce_scatter_tensor_autograd,
            getattr(fc, "all_gather_single", None) or fc.all_gather_tensor)


class ExpertShard:
    """Expert parallelism for one experts module: this rank holds experts start:stop of the module's E (its
    frozen weights hold only those), and the tokens routed to them are computed here. Two ways to bring them:

    - gathered (groups of up to top-k ranks): every rank's tokens and routing are all-gathered, each rank runs
      its own experts on the copies routed to them, and one reduce-scatter sums each token's outputs back on its
      rank. A token crosses to each other rank once (g - 1 rows a token); the one number read on the host is
      how many of the group's copies this rank's experts take. With `in_graph` (model.expert_exchange: graph)
      nothing is read on the host and the collectives are traced into the compiled layer (gathered_in_graph).
    - exchanged (larger groups): each routed copy is sent to its expert's rank with one all_to_all and back with
      another (top-k (g - 1) / g rows a token, fewer once g passes top-k); the split sizes are read on the host.

    The collectives' gradients travel back the same ways. The adapters stay whole on every rank under FSDP:
    this rank uses, and its gradient fills, only its experts' factors, and FSDP's reduce-scatter sums the ranks'
    gradients."""

    def __init__(self, rank: int, world: int, num_experts: int, group=None, in_graph: bool = False) -> None:
        self.rank, self.world, self.group, self.in_graph = rank, world, group, in_graph
        self.local = num_experts // world
        self.start, self.stop = rank * self.local, (rank + 1) * self.local

    def local_factors(self, lora: tuple) -> tuple:
        down, up, scale = lora
        return down[self.start:self.stop], up[self.start:self.stop], scale

    def gathers(self, top_k: int) -> bool:
        """Whether tokens come gathered (fewer bytes for groups up to top_k ranks)."""
        return self.world <= top_k

    def _one_more_row(self, counts: torch.Tensor) -> torch.Tensor:
        """counts with one row more for the last local expert: the zero row computed where none arrives."""
        return counts + torch.nn.functional.one_hot(
            torch.tensor(self.local - 1, device=counts.device), self.local).to(counts.dtype)

    def _local_order(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The group's routed copies (`index`, gathered) ordered with this rank's experts' first, sorted by local
        expert, and the other ranks' after them: (which copies are routed here, the order, rows per local
        expert)."""
        local = index.reshape(-1) - self.start
        mine = (local >= 0) & (local < self.local)
        key = torch.where(mine, local, self.local)
        return mine, torch.sort(key).indices, _counts(key, self.local + 1)[:-1]

    def gathered(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 compute) -> torch.Tensor:
        """The module's output for this rank's tokens: compute(rows, counts, weights) runs this rank's experts on
        the group's copies routed to them, sorted by local expert, counts[e] for local expert e. Their number is
        read on the host once (a 2 x H200 run with fixed-size tensors, the other ranks' copies zeroed, was no
        faster: every row-wise pass then moves the whole group's rows). Every rank of the group passes as many
        tokens: the trainer's batches have one shape on every rank (data.StepBatches, evaluate.evaluate)."""
        if self.in_graph:
            return self.gathered_in_graph(hidden, top_k_index, top_k_weights, compute)
        top_k = top_k_index.shape[-1]
        everyone, index, weights = _gather_routing(hidden, top_k_index, top_k_weights, self.group)
        _, order, counts = self._local_order(index)
        held = int(counts.sum())
        if held:
            order = order[:held]
            rows = _Pick.apply(everyone, order, everyone.shape[0], top_k)
            routed = weights.reshape(-1)[order]
        else:
            # No copy for this rank's experts: compute on one zero row (counted for the last local expert), as
            # the exchange below does. It stays in the graph, so this rank's backward joins the collectives.
            order = order[:1]
            rows = _Pick.apply(everyone, order, everyone.shape[0], top_k) * 0
            routed = weights.reshape(-1)[order] * 0
            counts = self._one_more_row(counts)
        out = compute(rows, counts, routed)
        return _sum_back(_SumCopies.apply(out, order, everyone.shape[0], top_k), self.group)

    def gathered_in_graph(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                          compute) -> torch.Tensor:
        """gathered's result with nothing read on the host: the collectives are torch's functional ones, which
        torch.compile traces into the layer's graph (no graph break, no wait for the host), and every copy of the
        group stays in place, this rank's experts' first (sorted by local expert) and the others' after them. The
        grouped GEMMs stop at this rank's last row; what they leave unwritten below it is masked out of the sums
        and, by the masks' gradients, out of the backward. The cost: the row-wise steps pass all the group's
        copies (on 2 ranks, twice gathered's), and peak memory grows with them."""
        import torch.distributed as dist

        gather, scatter, gather_plain = _functional_collectives()
        group = self.group if self.group is not None else dist.group.WORLD
        top_k = top_k_index.shape[-1]
        everyone = gather(hidden.contiguous(), 0, group)
        index = gather_plain(top_k_index.contiguous(), 0, group)
        weights = gather(top_k_weights.contiguous(), 0, group)
        mine, order, counts = self._local_order(index)
        held = mine[order]
        rows = torch.where(held.unsqueeze(-1), _Pick.apply(everyone, order, everyone.shape[0], top_k), 0)
        routed = torch.where(held, weights.reshape(-1)[order], 0)
        out = torch.where(held.unsqueeze(-1), compute(rows, counts, routed), 0)
        return scatter(_SumCopies.apply(out, order, everyone.shape[0], top_k), "sum", 0, group)

    def exchange(self, rows: torch.Tensor, counts: torch.Tensor, compute) -> torch.Tensor:
        """compute(local rows sorted by local expert, their counts) on the rows this rank's experts receive
        from every rank; the results back in the order of `rows` (sorted by global expert). The all_to_all way,
        for groups larger than top-k."""
        import torch.distributed as dist
        from torch.distributed.nn.functional import all_to_all_single

        counts = counts.to(torch.int64).view(self.world, self.local)  # [destination rank, its local expert]
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # [source rank, my local expert]
        send = counts.sum(dim=1).tolist()
        recv = received.sum(dim=1).tolist()  # the one host sync: the all_to_all's split sizes
        arrived = all_to_all_single(rows.new_empty(sum(recv), rows.shape[1]), rows, recv, send, group=self.group)
        # arrived: by source rank, then by local expert; compute wants them by local expert
        expert_of_row = torch.repeat_interleave(
            torch.arange(self.local, device=rows.device).repeat(self.world), received.flatten(),
            output_size=sum(recv))
        by_expert = torch.argsort(expert_of_row, stable=True)
        back = torch.empty_like(by_expert)
        back[by_expert] = torch.arange(by_expert.numel(), device=rows.device)
        local_counts = received.sum(dim=0)
        if sum(recv):
            out = _Permute.apply(compute(_Permute.apply(arrived, by_expert, back, 1), local_counts), back, by_expert, 1)
        else:
            # No row for this rank's experts: compute on one zero row (counted for the last local expert) and
            # drop it. grouped_mm's backward fails on an empty input (seen on 4 H200s, Qwen3-30B-A3B, step 12:
            # "Invalid strides/sizes, got [0, 1] for strides and [16, 0] for sizes"). The row's input is zero and
            # its output unused, so it adds nothing to any gradient; `arrived` (empty) stays in the graph so that
            # this rank's backward joins the exchange's as every other rank's does.
            zero = torch.cat([arrived, arrived.new_zeros(1, arrived.shape[1])])
            out = compute(zero, self._one_more_row(local_counts))[:0]
        return all_to_all_single(out.new_empty(rows.shape[0], out.shape[1]), out, send, recv, group=self.group)


def shard_experts(model: nn.Module, group, rank: int, world: int,
                  in_graph: bool = False) -> tuple[list[nn.Parameter], dict]:
    """Expert layouts: each covered experts module keeps only this rank's E/world experts of its frozen weights
    (`rank` and `world` within `group`, the layout's expert group; still on the meta device, filled by loading)
    and gets an ExpertShard exchanging tokens over that group (`in_graph`: model.expert_exchange: graph, for
    groups that gather). Returns those weights, which FSDP must leave
    alone, and each one's name mapped to (first expert, last + 1, full shape), for loading and parameter counts."""
    from peft.tuners.lora.layer import ParamWrapper

    from .config import ConfigError

    held, layout = [], {}
    for outer_name, module in model.named_modules():
        if not isinstance(module, grouped_wrapper_type()):
            continue
        chain, experts = _wrapper_chain(module, ParamWrapper)
        prefix = outer_name + ".base_layer" * len(chain)
        if experts.num_experts % world:
            raise ConfigError(f"model.parallelism: {experts.num_experts} experts do not split evenly over "
                              f"{world} ranks (an expert layout needs a rank count that divides them)")
        experts.expert_shard = shard = ExpertShard(rank, world, experts.num_experts, group, in_graph)
        for name, param in list(experts.named_parameters(recurse=False)):
            if param.dim() != 3:
                continue
            local = nn.Parameter(torch.empty(shard.local, *param.shape[1:], dtype=param.dtype, device=param.device),
                                 requires_grad=False)
            setattr(experts, name, local)
            held.append(local)
            layout[f"{prefix}.{name}"] = (shard.start, shard.stop, tuple(param.shape))
    if not held:
        raise ConfigError("model.parallelism: the model has no fused experts with LoRA on the grouped path "
                          "(a transformers 5 Mixture-of-Experts model, lora.target_parameters: auto, "
                          "model.moe_kernel: grouped)")
    return held, layout


def _wrapper_chain(outer: nn.Module, wrapper_type: type) -> tuple[list[nn.Module], nn.Module]:
    chain, module = [], outer
    while isinstance(module, wrapper_type):
        chain.append(module)
        module = module.base_layer
    return chain, module


def _covered(chain: list[nn.Module], experts: nn.Module) -> str | None:
    """Why the grouped path cannot stand in for this experts module, or None."""
    if not hasattr(experts, "num_experts") or not hasattr(experts, "down_proj"):
        return f"{type(experts).__name__} has no fused expert weights"
    if getattr(experts, "is_concatenated", True) is False and not hasattr(experts, "_apply_gate"):
        return "interleaved gate/up weights without a gate function"
    if getattr(experts, "has_bias", False):
        return "expert biases (not on the grouped path yet)"
    for wrapper in chain:
        if wrapper.parameter_name not in PROJECTIONS or wrapper.num_experts != experts.num_experts:
            return f"LoRA on {wrapper.parameter_name}"
    return None


@functools.cache
def grouped_wrapper_type() -> type:
    """peft's ParamWrapper with the grouped forward: the outermost wrapper of a covered experts module becomes one
    (its class is swapped; names, parameters and state stay peft's). A method of a class, not a per-module
    callable, so that torch.compile traces every layer with one graph (an object per layer is a guard per layer,
    and past the recompile limit the remaining layers would run uncompiled)."""
    from peft.tuners.lora.layer import ParamWrapper

    class GroupedParamWrapper(ParamWrapper):
        def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    *args, **kwargs) -> torch.Tensor:
            chain, experts = _wrapper_chain(self, ParamWrapper)
            peft_only = args or kwargs or getattr(experts, "_is_expert_parallel", False) or any(
                w.merged or len(w.active_adapters) != 1 for w in chain)
            if peft_only and getattr(experts, "expert_shard", None) is not None:
                raise RuntimeError("experts sharded by model.expert_parallel run only the grouped path (no merged "
                                   "adapters, one active adapter)")
            if peft_only and any(fp8.has_fp8(experts, name) for name in PROJECTIONS):
                raise RuntimeError("experts in FP8 (model.fp8_experts) run only the grouped path (no merged "
                                   "adapters, one active adapter)")
            if peft_only:
                return super().forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
            adapters = {w.parameter_name: lora_factors(w, hidden_states.dtype) for w in chain}
            return grouped_forward(experts, adapters, hidden_states, top_k_index, top_k_weights)

    return GroupedParamWrapper


def _outer_wrappers(model: nn.Module):
    """(name, outermost LoRA wrapper of a fused experts module, why the grouped path cannot cover it or None)."""
    from peft.tuners.lora.layer import ParamWrapper

    inner = {id(m.base_layer) for m in model.modules() if isinstance(m, ParamWrapper)}
    for name, module in model.named_modules():
        if isinstance(module, ParamWrapper) and id(module) not in inner:
            yield name, module, _covered(*_wrapper_chain(module, ParamWrapper))


def coverable(model: nn.Module) -> bool:
    """Whether install would give some experts module of this model (a skeleton will do) the grouped path."""
    return any(reason is None for _, _, reason in _outer_wrappers(model))


def install(model: nn.Module, kernel: str = "torch") -> tuple[int, list[str]]:
    """Give the outermost LoRA wrapper of every fused experts module the grouped forward, its adapter's products
    in `kernel`: triton or torch (lora_kernel resolves auto). Returns how many modules it covers and, for the
    others, why not (they keep peft's forward)."""
    from peft.tuners.lora.layer import ParamWrapper

    covered, skipped = 0, []
    for name, module, reason in list(_outer_wrappers(model)):
        if reason:
            skipped.append(f"{name}: {reason}")
            continue
        module.__class__ = grouped_wrapper_type()
        _wrapper_chain(module, ParamWrapper)[1].lora_kernel = kernel
        covered += 1
    return covered, skipped


def quantize_experts(model: nn.Module) -> int:
    """Give every experts module on the grouped path (moe.install) e4m3 copies of its frozen projections and
    release their bf16 storage (the parameter keeps its shape and dtype as a one-element broadcast view, so counts
    and names stay; nothing reads its values on the grouped path). Returns how many weights were converted."""
    from peft.tuners.lora.layer import ParamWrapper

    converted = 0
    for module in model.modules():
        if type(module) is not grouped_wrapper_type():
            continue
        _, experts = _wrapper_chain(module, ParamWrapper)
        for name in PROJECTIONS:
            param = getattr(experts, name, None)
            if not isinstance(param, torch.Tensor) or param.dim() != 3 or fp8.has_fp8(experts, name):
                continue
            fp8.hold_in_fp8(experts, name, _base_weight(experts, name).transpose(-2, -1))  # (experts, out, in)
            converted += 1
    return converted
