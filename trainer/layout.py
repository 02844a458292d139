"""Where the weights live and which links carry what: the parallel layout (model.parallelism).

A layout says how the frozen base, the LoRA adapters and a Mixture-of-Experts model's routed experts are spread
over the ranks, and over which process groups the collectives run:

- replicate: every rank holds the whole frozen base (nothing to all-gather); the adapters are FSDP's, sharded
  over the GPUs of a node and replicated across nodes, so only adapter gradients are reduced.
- hsdp: base and adapters sharded over the GPUs of each node and replicated across nodes (a 2-D mesh): the
  per-layer all-gathers stay inside the node; only the gradients' shards cross it. On one node: fsdp.
- fsdp: base and adapters sharded over every rank (one 1-D mesh); each layer's all-gathers cross nodes.
- expert: the routed experts split over the GPUs of each node (tokens reach them inside the node: gathered to
  every GPU of the node when it has at most top-k of them, else by all_to_all); the rest as hsdp.
- expert-global: the routed experts split over every rank; the rest as fsdp (model.expert_parallel: true).

auto picks the first of replicate, expert, hsdp (several nodes), fsdp whose estimated memory fits the GPU, and
says why. expert only where the routed experts run on the grouped path and a node's GPUs are between 2 and top-k
(the gathered exchange): where the whole base does not fit on each GPU, it gathers no expert weight, and on 2
H200s it ran GLM-4.5-Air's shape at 1.40x fsdp's tokens/s (docs/PERFORMANCE.md). Where the base fits, replicate
stays first: it was faster than expert (0.63x) on Qwen3-30B-A3B.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from .config import LAYOUTS  # noqa: F401 - the names, kept where the controller reads the recipe's checks

FITS = 0.92                 # of the GPU's memory, what an estimate may use (allocator slack, fragmentation)
WORKSPACE = 3e9             # CUDA context, NCCL buffers, kernels' scratch
# A decoder layer keeps for its backward about 6 + 3 x (MLP width / hidden) + 1.75 x top-k hidden-state-sized
# tensors per token (the MLP width: intermediate_size, or top-k x an expert's width; the top-k term: the routed
# copies). Fitted on three H200 runs through nodectl launch: 8B dense, micro-batch 4 x 4096, no checkpointing (93.5
# GB measured); Qwen3-30B-A3B, 2 x 4096, 10% checkpointed (118.6 GB); GLM-4.5-Air over 4 GPUs, 2 x 4096, half
# checkpointed (125.4 GB), and over 2 x 2 GPUs, 1 x 4096, all checkpointed (136.2 GB).
BASE_WIDTHS, MLP_WIDTHS, ROUTED_WIDTHS = 6.0, 3.0, 1.75
# The expert layouts' gathered exchange (trainer/moe.py, ExpertShard.gathered: groups up to top-k GPUs) keeps per
# layer about the group's routed copies once more, g x top-k hidden states per token. Fitted on 2 H200s
# (2026-11-28) while each rank's partial sums were placed in a zero-filled buffer: Qwen3-30B-A3B, micro-batch
# 2 x 4096, 10% checkpointed, 106.5 GB measured (108.2 estimated with it, 84.6 without). Since the sum is compiled
# as gathers added up (moe._added_up) the same run peaks at 83.4 GB and GLM-4.5-Air's 32 layers at 1 x 4096, no
# layer checkpointed, at 130.0 (135.3 estimated; 146.6 before): kept as a margin, 25 GB over on the first.
GATHERED_COPIES = 1.0


@dataclass(frozen=True)
class Shape:
    """What the estimates need from the model and the recipe."""
    frozen_bytes: int        # the frozen base at full size
    trainable: int           # LoRA parameters (fp32 master weights, gradients, two AdamW moments)
    expert_bytes: int        # of frozen_bytes, the routed experts' fused weights
    layers: int
    hidden: int
    checkpointed: int        # layers that recompute their activations in backward
    tokens: int              # per micro-batch (rows x max_length)
    top_k: int               # experts per token (0: dense)
    mlp_ratio: float = 3.5   # the MLP's width over hidden (top-k experts' widths on a Mixture-of-Experts model)
    element: int = 2         # bytes of a gathered adapter weight and of a hidden state (bf16; fp32 on CPU ranks)
    active_bytes: int = 0    # of frozen_bytes, what one token passes through (the top-k of the routed experts);
                             # 0: all of it
    experts: int = 0         # routed experts per layer
    grouped: bool = False    # whether they run on the grouped path with LoRA (what the expert layouts shard)

    @property
    def width(self) -> int:
        """Bytes of one hidden-state-sized tensor of the micro-batch."""
        return self.tokens * self.hidden * 2

    @property
    def holding_layers(self) -> int:
        """Layers whose activations are held at once: those not checkpointed, and the one recomputing."""
        return self.layers - self.checkpointed + (1 if self.checkpointed else 0)

    @property
    def activations(self) -> float:
        per_layer = BASE_WIDTHS + MLP_WIDTHS * self.mlp_ratio + ROUTED_WIDTHS * self.top_k
        return self.width * (per_layer * self.holding_layers + self.checkpointed)


@dataclass(frozen=True)
class Layout:
    name: str                # replicate, hsdp, fsdp, expert, expert-global
    world: int
    nodes: int               # nodes the mesh knows (1 when ranks do not split evenly into nodes)
    per_node: int
    reason: str

    @property
    def two_d(self) -> bool:
        """A (replicate across nodes, shard inside) mesh for FSDP."""
        return self.nodes > 1 and self.name in ("replicate", "hsdp", "expert")

    @property
    def frozen_sharded(self) -> bool:
        return self.name != "replicate" and self.world > 1

    @property
    def expert_group_size(self) -> int:
        return {"expert": self.per_node, "expert-global": self.world}.get(self.name, 0)

    def describe(self) -> str:
        shape = f"{self.nodes} node(s) x {self.per_node}" if self.nodes > 1 else f"{self.world} rank(s)"
        return f"layout: {self.name} over {shape} ({self.reason})"


def topology() -> tuple[int, int, int]:
    """(world, nodes, ranks per node) from torchrun's environment; one node when they do not divide evenly."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world)) or world
    if per_node < 1 or world % per_node:
        return world, 1, world
    return world, world // per_node, per_node


def auto_order(shape: Shape, world: int, nodes: int, per_node: int, leaves_out: bool = True) -> list[str]:
    """The layouts auto tries, in its order: the first whose estimate fits is taken. The less a layout gathers, the
    earlier: replicate gathers nothing; expert gathers the base less its routed experts, and its tokens travel
    inside the node (only where they come gathered, 2 to top-k GPUs a node); hsdp gathers the base inside the
    node; fsdp across nodes."""
    if world == 1:
        return ["replicate"]
    names = ["replicate"] if leaves_out else []
    if (leaves_out and shape.grouped and shape.top_k and 1 < per_node <= shape.top_k and shape.experts
            and shape.experts % per_node == 0):
        names.append("expert")
    return names + (["hsdp"] if nodes > 1 else []) + ["fsdp"]


def per_gpu_bytes(name: str, shape: Shape, world: int, per_node: int) -> float:
    """Estimated peak bytes on one GPU under a layout."""
    frozen_share = {"replicate": 1, "hsdp": per_node, "fsdp": world, "expert": per_node,
                    "expert-global": world}[name] if world > 1 else 1
    adapter_share = world if name in ("fsdp", "expert-global") else per_node
    gathered = 0.0 if name == "replicate" or world == 1 else 2 * (shape.frozen_bytes - shape.expert_bytes *
                                                                   (name.startswith("expert"))) / shape.layers
    group = {"expert": per_node, "expert-global": world}.get(name, 0) if world > 1 else 0
    exchange = GATHERED_COPIES * group * shape.top_k * shape.width * shape.holding_layers \
        if 1 < group <= shape.top_k else 0.0
    return (shape.frozen_bytes / frozen_share + 16 * shape.trainable / max(1, adapter_share) + gathered
            + shape.activations + exchange + WORKSPACE)


def fsdp_leaves_params_out() -> bool:
    """Whether this torch's fully_shard takes ignored_params (2.7+): what keeping a weight out of FSDP (a
    replicated base, a rank's own experts) needs."""
    import inspect

    from torch.distributed.fsdp import fully_shard

    return "ignored_params" in inspect.signature(fully_shard).parameters


def choose(setting: str, shape: Shape, memory: float | None, world: int, nodes: int, per_node: int,
           leaves_out: bool = True, unit: str = "GPU") -> Layout:
    """The layout for `setting` (a name, or auto) on this topology; `memory`: one GPU's bytes (None: unknown);
    `leaves_out`: whether FSDP can keep weights out (fsdp_leaves_params_out); `unit`: what a rank runs on, as the
    reason names it ("rank" on CPU)."""
    import torch

    from .config import ConfigError

    if setting != "auto":
        if setting.startswith("expert") and not shape.top_k:
            raise ConfigError(f"model.parallelism: {setting} needs a Mixture-of-Experts model with fused experts")
        if setting in ("replicate", "expert", "expert-global") and world > 1 and not leaves_out:
            raise ConfigError(f"model.parallelism: {setting} needs torch >= 2.7 (FSDP's ignored_params); this node "
                              f"has {torch.__version__}")
        return Layout(setting, world, nodes, per_node, "forced by model.parallelism")
    if world == 1:
        return Layout("replicate", 1, 1, 1, "one rank: the whole model here, nothing to gather")
    gib = 1e9
    budget = FITS * memory if memory else None
    need = {name: per_gpu_bytes(name, shape, world, per_node) for name in ("replicate", "expert", "hsdp", "fsdp")}
    fits = [name for name in auto_order(shape, world, nodes, per_node, leaves_out)
            if budget is None or need[name] <= budget]
    chosen = fits[0] if fits else "fsdp"
    memory_text = f"{memory / gib:.0f} GB" if memory else "unknown"
    why = {"replicate": f"the frozen base ({shape.frozen_bytes / gib:.1f} GB) fits on every {unit}: est. "
                        f"{need['replicate'] / gib:.0f} GB of {memory_text}; nothing to all-gather, only adapter "
                        f"gradients are reduced",
           "expert": f"the base does not fit whole on every {unit} (est. {need['replicate'] / gib:.0f} GB of "
                     f"{memory_text}); the routed experts ({shape.expert_bytes / gib:.1f} GB) split over a node's "
                     f"{per_node} {unit}s and never gathered, each token's hidden state gathered to them inside "
                     f"the node, the rest sharded: est. {need['expert'] / gib:.0f} GB",
           "hsdp": f"the base sharded over a node's {per_node} {unit}s fits (est. {need['hsdp'] / gib:.0f} GB of "
                   f"{memory_text}; whole on each: {need['replicate'] / gib:.0f} GB); all-gathers stay inside the "
                   f"node, only gradient shards cross it",
           "fsdp": f"sharded over all {world} ranks: est. {need['fsdp'] / gib:.0f} GB of {memory_text}"
                   + (f" (whole on each: {need['replicate'] / gib:.0f} GB"
                      + (f", over a node: {need['hsdp'] / gib:.0f} GB" if nodes > 1 else "") + ")")}[chosen]
    if not fits:
        why += "; nothing fits by the estimate: lower train.micro_batch_size or checkpoint more layers"
    return Layout(chosen, world, nodes, per_node, "auto: " + why)


# What `auto` for train.micro_batch_size and model.activation_checkpointing weighs: an estimate of the time per
# token of each split that fits, not a measurement. A token costs about 4 x the active weights in FLOPs (forward;
# backward for the inputs only, the base being frozen), a checkpointed layer's forward once more (2 x), at an
# achieved rate that falls for small micro-batches (half the rate at HALF_RATE_TOKENS); a sharded base's
# all-gathers run beside the compute (over NVLink inside a node, the network across), and EXPOSED of the shorter
# of the two is still waited for. Against the runs of docs/PERFORMANCE.md: GLM-4.5-Air over 4 H200s, 2 x 4096 half
# checkpointed, est. 317 us per token per GPU (measured 317); 1 x 4096 all checkpointed, est. 452 (measured 481);
# Qwen3-30B-A3B on one H200, 2 x 4096 with 10% checkpointed, est. 65 (measured 64-66).
CHECKPOINT_SHARES = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0)
GPU_FLOPS, NVLINK, NETWORK = 250e12, 350e9, 40e9    # achieved bf16 FLOP/s; bytes/s a GPU sends inside, across nodes
HALF_RATE_TOKENS = 1024
EXPOSED = 0.4               # of the shorter of compute and all-gathers, what the overlap leaves waited for


@dataclass(frozen=True)
class Split:
    """A micro-batch and checkpointed share, under a layout, with what it is estimated to need and cost."""
    layout: str
    micro: int
    share: float
    need: float               # bytes per GPU
    seconds_per_token: float
    reason: str = ""

    def describe(self, rows: int, layers: int) -> str:
        checkpointed = round(self.share * layers)
        return (f"micro-batch {self.micro} of {rows} row(s) per step ({rows // self.micro} accumulated), "
                f"{checkpointed}/{layers} layers checkpointed")


def seconds_per_token(name: str, shape: Shape, world: int, nodes: int, per_node: int) -> float:
    """The estimated time per token of a micro-batch of `shape` under a layout (see GPU_FLOPS)."""
    active = (shape.active_bytes or shape.frozen_bytes) / shape.element
    recompute = shape.checkpointed / max(1, shape.layers)
    compute = shape.tokens * (4 + 2 * recompute) * active / GPU_FLOPS * (1 + HALF_RATE_TOKENS / shape.tokens)
    sent = traffic(Layout(name, world, nodes if nodes > 1 else 1, per_node, ""), shape, True)
    wire = sent["intra_node_bytes"] / NVLINK + sent["inter_node_bytes"] / NETWORK
    return (max(compute, wire) + EXPOSED * min(compute, wire)) / shape.tokens


def plan(setting: str, shape: Shape, memory: float | None, world: int, nodes: int, per_node: int, *,
         rows: int, max_length: int, micro: int | None, share: float | None, leaves_out: bool = True,
         unit: str = "GPU") -> tuple[Layout, Split]:
    """The layout, micro-batch and checkpointed share for a step of `rows` rows per rank: `micro` or `share` None
    (auto) tries every divisor of `rows` and every share of CHECKPOINT_SHARES. The layout is the first, in auto's
    order (choose), with a split estimated to fit; the split, the one of those estimated fastest. The split's
    reason names the runner-up."""
    from .model import checkpointed_layers

    layouts = [setting] if setting != "auto" else auto_order(shape, world, nodes, per_node, leaves_out)
    micros = [micro] if micro else [m for m in range(rows, 0, -1) if rows % m == 0]
    shares = [share] if share is not None else list(CHECKPOINT_SHARES)
    budget = FITS * memory if memory else None
    splits = []
    for name in layouts:
        for m in micros:
            for s in shares:
                trial = dataclasses.replace(shape, tokens=m * max_length,
                                            checkpointed=len(checkpointed_layers(shape.layers, s)))
                splits.append(Split(name, m, s, per_gpu_bytes(name, trial, world, per_node),
                                    seconds_per_token(name, trial, world, nodes, per_node)))
    fitting = [x for x in splits if budget is None or x.need <= budget]
    # the layout as auto orders them (auto_order: the less gathered, the faster on the measured runs), then the split
    first = next((name for name in layouts if any(x.layout == name for x in fitting)), None)
    fitting = sorted((x for x in fitting if x.layout == first), key=lambda x: (x.seconds_per_token, -x.micro, x.share))
    best = fitting[0] if fitting else min(splits, key=lambda x: x.need)
    trial = dataclasses.replace(shape, tokens=best.micro * max_length,
                                checkpointed=len(checkpointed_layers(shape.layers, best.share)))
    layout = choose(setting, trial, memory, world, nodes, per_node, leaves_out, unit)
    gib, memory_text = 1e9, f"{memory / 1e9:.0f} GB" if memory else "unknown"
    why = (f"auto: {best.describe(rows, shape.layers)}: est. {best.need / gib:.0f} GB of {memory_text}, "
           f"{best.seconds_per_token * 1e6:.1f} us per token")
    runner_up = next((x for x in fitting[1:] if (x.micro, x.share) != (best.micro, best.share)), None)
    if runner_up:
        why += f"; next: {runner_up.describe(rows, shape.layers)} ({runner_up.seconds_per_token * 1e6:.1f} us)"
    if not fitting:
        why += "; nothing fits by the estimate: the smallest split is tried (lower train.batch_size)"
    return layout, dataclasses.replace(best, reason=why)


def mesh(layout: Layout, device_type: str):
    """The DeviceMesh FSDP shards over: (replicate, shard) across and inside nodes, or one dimension."""
    from torch.distributed.device_mesh import init_device_mesh

    if layout.two_d:
        return init_device_mesh(device_type, (layout.nodes, layout.per_node), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (layout.world,), mesh_dim_names=("shard",))


def expert_group(layout: Layout, fsdp_mesh):
    """(process group, rank in it, its size) over which the routed experts are split; None without expert
    parallelism. expert: the node's ranks (the mesh's shard dimension); expert-global: every rank."""
    import torch.distributed as dist

    if layout.name == "expert" and layout.two_d:
        sub = fsdp_mesh["shard"]
        return sub.get_group(), sub.get_local_rank(), sub.size()
    if layout.name in ("expert", "expert-global"):
        return dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    return None


def ring_split(sent: float, group: int, spans: int) -> tuple[float, float]:
    """(inside, across) of what one rank of a ring over `group` ranks on `spans` nodes sends: the ring crosses a
    node boundary on `spans` of its `group` links, so that share of a rank's bytes crosses on average."""
    across = spans / group if spans > 1 else 0.0
    return sent * (1 - across), sent * across


def traffic(layout: Layout, shape: Shape, reshard_after_forward: bool) -> dict[str, float]:
    """Bytes one GPU sends in one optimizer step of one micro-batch, by the ring accounting of each collective
    (all-gather and reduce-scatter: (g-1)/g of the whole tensor; all-reduce twice that; all_to_all: what goes to
    other ranks), split into inside the node and across nodes (a ring over m nodes crosses a node boundary on m
    of its g links)."""
    intra = inter = 0.0
    world, nodes, per_node = layout.world, layout.nodes, layout.per_node

    def ring(total: float, group: int, spans: int) -> None:
        nonlocal intra, inter
        if group < 2:
            return
        inside, across = ring_split(total * (group - 1) / group, group, spans)
        intra += inside
        inter += across

    passes = 2 if reshard_after_forward else 1
    adapters_bf16, grads_fp32 = shape.element * shape.trainable, 4 * shape.trainable
    expert = layout.expert_group_size
    frozen_gathered = shape.frozen_bytes - (shape.expert_bytes if expert else 0)
    if layout.name in ("fsdp", "expert-global"):
        ring(passes * (frozen_gathered + adapters_bf16), world, nodes)
        ring(grads_fp32, world, nodes)
    else:
        inside = per_node if layout.two_d else world
        if layout.name != "replicate":
            ring(passes * frozen_gathered, inside, 1)
        ring(passes * adapters_bf16, inside, 1)
        ring(grads_fp32, inside, 1)                          # reduce-scatter inside the node
        if layout.two_d:
            ring(2 * grads_fp32 / per_node, nodes, nodes)    # all-reduce of each shard across the nodes
    if expert and shape.top_k:
        # per layer and pass, one rank's share of its tokens' hidden states on the way to the experts and back:
        # gathered (groups up to top-k ranks), each token once to every other rank of the group, with its expert
        # ids and routing weights, and its outputs summed back; exchanged, each routed copy to its expert's rank
        if expert <= shape.top_k:
            routing = shape.top_k * (8 + 2 * shape.element) / 2          # ids and weights, weights' gradient
            there_and_back = shape.tokens * (expert - 1) * (2 * shape.hidden * shape.element + routing)
        else:
            there_and_back = shape.tokens * shape.top_k * (expert - 1) / expert * 2 * shape.hidden * shape.element
        exchanges = there_and_back * shape.layers * (2 + shape.checkpointed / shape.layers)  # backward, recompute
        spans = nodes if layout.name == "expert-global" else 1
        if expert <= shape.top_k:     # rings, as the all-gathers and reduce-scatters are counted
            inside, across = ring_split(exchanges, expert, spans)
        else:                         # each peer its share
            across = exchanges * ((world - per_node) / (world - 1) if spans > 1 and world > 1 else 0.0)
            inside = exchanges - across
        intra += inside
        inter += across
    return {"intra_node_bytes": intra, "inter_node_bytes": inter}


def shape_of(model, recipe) -> Shape:
    """The estimates' inputs from the model skeleton (meta device, LoRA applied) and the recipe."""
    from . import moe
    from .model import checkpointed_layers, decoder_layers, parameter_counts

    trainable, _ = parameter_counts(model)
    share, micro = recipe.model.activation_checkpointing, recipe.train.micro_batch_size
    share = 0.0 if share == "auto" else share     # placeholders for auto, which tries them all (plan)
    frozen_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    expert_bytes = sum(p.numel() * p.element_size() for m in model.modules() if "Expert" in type(m).__name__
                       for p in m.parameters(recurse=False) if p.dim() == 3 and not p.requires_grad)
    config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
    layers = len(decoder_layers(model))
    top_k = int(getattr(config, "num_experts_per_tok", 0) or 0) if expert_bytes else 0
    expert_width = getattr(config, "moe_intermediate_size", None) or getattr(config, "intermediate_size", 0)
    mlp = top_k * expert_width if top_k else getattr(config, "intermediate_size", 0) or 3.5 * config.hidden_size
    experts = int(getattr(config, "num_experts", 0) or getattr(config, "n_routed_experts", 0)
                  or getattr(config, "num_local_experts", 0) or 0)
    active = frozen_bytes - (expert_bytes * (1 - top_k / experts) if top_k and experts else 0)
    grouped = bool(top_k) and recipe.model.moe_kernel == "grouped" and moe.coverable(model)
    return Shape(frozen_bytes=frozen_bytes, trainable=trainable, expert_bytes=expert_bytes, layers=layers,
                 hidden=config.hidden_size, checkpointed=len(checkpointed_layers(layers, share)),
                 tokens=(micro if isinstance(micro, int) else 1) * recipe.data.max_length,
                 top_k=top_k, mlp_ratio=mlp / config.hidden_size,
                 element=next(p.element_size() for p in model.parameters() if not p.requires_grad),
                 active_bytes=int(active), experts=experts, grouped=grouped)


def device_memory(device) -> float | None:
    """One GPU's bytes; on CPU ranks, the host's memory over the node's ranks."""
    import torch

    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    return total / max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
