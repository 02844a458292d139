"""Building the model: meta-device construction, LoRA (peft), activation checkpointing, FSDP2, and loading the
real weights: each rank reads its own shards from its node's copy (model.load: sliced), or rank 0 reads them
all and hands each rank its shards (model.load: broadcast)."""
from __future__ import annotations

import math
import re
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import torch
from torch import nn

from .config import ConfigError, Recipe
from .weights import Checkpoint, hf_name

NO_EXPERTS: Mapping = MappingProxyType({})   # no expert layout: every rank holds every expert


@contextmanager
def peft_false_alarms():
    """peft's warnings that say nothing true of the trainer's adapters, silenced while peft builds or loads one:
    it checks rank_pattern/alpha_pattern keys against the targeted modules alone, and ours name fused expert
    weights (target_parameters), which it does give those ranks; and it asks transformers 5 for the deprecated
    is_gradient_checkpointing. Every other warning still shows."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"The following (rank|alpha)_pattern keys did not match", RuntimeWarning)
        warnings.filterwarnings("ignore", r"`is_gradient_checkpointing` is deprecated", FutureWarning)
        yield


def build_skeleton(recipe: Recipe, model_path: Path, dtype: torch.dtype) -> nn.Module:
    """The model with LoRA, on the meta device: no memory, no collectives, so a bad recipe fails everywhere
    at once before any process group exists."""
    import peft
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.to(dtype)
    lora = lora_config(model, recipe)
    try:
        with peft_false_alarms():
            model = peft.get_peft_model(model, lora)
    except ValueError as exc:
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ConfigError(f"lora.target_modules: {list(recipe.lora.target_modules)} matches no module of the "
                          f"model ({exc.__class__.__name__}); its linear layers are {linear}") from None
    for name, param in model.named_parameters():
        if param.requires_grad:
            param.data = param.data.to(torch.float32)  # adapters train in fp32; the frozen base stays in dtype
    return model


def lora_config(model: nn.Module, recipe: Recipe):
    """peft's LoraConfig for the recipe on this model.

    On a model with fused experts (transformers 5), peft re-maps the expert projections' old names in
    target_modules (gate_proj, up_proj, down_proj; w1, w2, w3) onto the fused weights, and no nn.Linear of those
    names keeps its LoRA: a shared expert's or a dense layer's MLP would stay frozen (peft issue 3711). Those
    linear layers are targeted by their weights instead (target_parameters, 2-D: the same W + scale*B@A), which
    peft keeps as written, also when PeftModel loads the adapter.

    Fused expert weights get the rank split peft documents for its own conversion: a weight fusing n projections
    (gate_up_proj: gate and up) gets rank n*r and alpha n*alpha, the capacity (and alpha/r) of n separate LoRAs."""
    import peft

    from .weights import expert_fusions

    fusions = expert_fusions(model)  # gate_up_proj -> [gate_proj, up_proj], ...
    experts = expert_targets(model, recipe.lora.target_parameters)
    modules, linear_weights = list(recipe.lora.target_modules), []
    renamed = {leaf for parts in fusions.values() for leaf in parts}
    if fusions:
        clash = [t for t in modules if t.rsplit(".", 1)[-1] in renamed]
        modules = [t for t in modules if t not in clash]
        linear_weights = sorted({".".join(name.split(".")[-2:]) + ".weight" for name, m in model.named_modules()
                                 if isinstance(m, nn.Linear) and any(name == t or name.endswith("." + t)
                                                                     for t in clash)})
    extra: dict = {}
    if experts or linear_weights:
        if recipe.lora.dropout:
            raise ConfigError(f"lora.dropout: peft's LoRA on fused expert weights ({', '.join(experts)}) and on "
                              f"weights it adapts as parameters has no dropout; set lora.dropout: 0")
        extra["target_parameters"] = experts + linear_weights
        rank, alpha = recipe.lora.expert_r or recipe.lora.r, recipe.lora.alpha
        pattern = {name: len(fusions.get(name.rsplit(".", 1)[-1], [None])) for name in experts}
        extra["rank_pattern"] = {re.escape(n): rank * k for n, k in pattern.items() if rank * k != recipe.lora.r}
        extra["alpha_pattern"] = {re.escape(n): alpha * k for n, k in pattern.items() if k > 1}
    return peft.LoraConfig(r=recipe.lora.r, lora_alpha=recipe.lora.alpha, lora_dropout=recipe.lora.dropout,
                           target_modules=modules, task_type="CAUSAL_LM", **extra)


def fused_expert_weights(model: nn.Module) -> list[str]:
    """The model's fused expert weights by their last three name parts (mlp.experts.gate_up_proj): 3-D
    parameters, experts first, of an *Experts module. nn.Linear LoRA cannot reach them; peft's
    target_parameters can."""
    names = set()
    for module_name, module in model.named_modules():
        if "Expert" in type(module).__name__:
            for name, param in module.named_parameters(recurse=False):
                if param.dim() == 3:
                    names.add(".".join(f"{module_name}.{name}".split(".")[-3:]))
    return sorted(names)


def expert_targets(model: nn.Module, setting: tuple[str, ...]) -> list[str]:
    """lora.target_parameters resolved against the model: auto (every fused expert weight), none, or names."""
    fused = fused_expert_weights(model)
    if setting == ("auto",):
        return fused
    if setting == ("none",):
        return []
    names = [name for name, _ in model.named_parameters()]
    unknown = [t for t in setting if not any(n == t or n.endswith("." + t) for n in names)]
    if unknown:
        raise ConfigError(f"lora.target_parameters: {unknown} names no parameter of the model; its fused expert "
                          f"weights are {fused or 'none (not a Mixture-of-Experts model with fused experts)'}")
    return list(setting)


def inactive_expert_params(model: nn.Module, experts: Mapping = NO_EXPERTS) -> tuple[int, int]:
    """(frozen, trainable) expert weights a token is not multiplied by: of E experts, each token goes through
    top-k (the config's num_experts_per_tok), so (1 - k/E) of every fused expert weight, and of the per-expert
    LoRA factors peft keeps beside it, is idle for it. Subtracted from the parameters that model FLOPs (and MFU)
    count."""
    from peft.tuners.lora.layer import ParamWrapper

    config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
    top_k = getattr(config, "num_experts_per_tok", None)
    frozen = trainable = 0
    if not top_k:
        return 0, 0
    shapes = _full_shapes(model, experts)
    for module_name, module in model.named_modules():
        experts = getattr(module, "num_experts", 0) if isinstance(module, ParamWrapper) else 0
        if "Expert" in type(module).__name__:
            for name, _ in module.named_parameters(recurse=False):
                shape = shapes[f"{module_name}.{name}" if module_name else name]
                if len(shape) == 3 and shape[0] > top_k:
                    frozen += math.prod(shape) * (shape[0] - top_k) // shape[0]
        elif experts > top_k:  # an expert stack's LoRA: experts x r rows of A, columns of B
            for param in (*module.lora_A.parameters(), *module.lora_B.parameters()):
                trainable += param.numel() * (experts - top_k) // experts
    return frozen, trainable


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) and "DecoderLayer" in type(module[0]).__name__:
            return list(module)
    raise ConfigError("model: no decoder layers found (a Hugging Face causal LM with *DecoderLayer blocks)")


def _adapter_linears(module: nn.Module) -> list[nn.Module]:
    """The LoRA Linear layers themselves (lora_A.default, ...): peft calls these, never their ModuleDicts, so
    FSDP's forward hooks must sit on them."""
    return [m for name, m in module.named_modules()
            if isinstance(m, nn.Linear) and name.rsplit(".", 2)[-2:-1] in (["lora_A"], ["lora_B"])]


def checkpointed_layers(count: int, setting: bool | float) -> list[int]:
    """Which decoder layers recompute their activations in backward: all (true), none (false), or a fraction
    of them spread evenly over the depth (the memory a run needs, and no more recomputation than that)."""
    share = float(setting)
    chosen = round(share * count)
    return [int(i * count / chosen) for i in range(chosen)] if chosen else []


def _checkpoint_forward(layer: nn.Module) -> None:
    """Non-reentrant activation checkpointing around the layer's own forward, inside its FSDP hooks (the
    reentrant kind re-runs forward hooks and is what makes DDP report "marked ready twice"). Parameter names do
    not change, so checkpoints and adapters keep the model's names."""
    from torch.utils.checkpoint import checkpoint

    forward = layer.forward

    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    layer.forward = checkpointed


def _fsdp_takes_mixed_frozen_dtypes() -> bool:
    """FSDP2 requires one original dtype per unit; from torch 2.8 only among trainable parameters (pytorch
    #154103), so a frozen bf16 block and its fp32 adapters can share a unit. Earlier, adapters need their own."""
    from torch.torch_version import TorchVersion

    return TorchVersion(torch.__version__.split("+")[0]) >= "2.8"


def compile_settings(numerics: str) -> None:
    """torch's compiler settings for model.compile.

    Numerics: fused kernels keep fp32 between operations that eager PyTorch rounds to bf16 one by one. That is more
    precise, but early LoRA updates (far below the bf16 resolution of the frozen layer's output, which eager
    rounds them into) then move the loss sooner than eager does: measured on the 8B bench, up to 2% lower loss
    in steps 2-10, the same curve after. "eager" makes Inductor round where eager does, for the same curve.

    Checkpointed layers: Dynamo refuses a layer whose checkpointed forward changes Python state (it would not be
    done again when backward recomputes the forward), and the whole layer then runs uncompiled, silently.
    transformers 5.2x's hub-kernel wrapper (the `kernels` package, which it requires) sets and restores a context
    variable in every wrapped module's forward: with transformers 5.25 on a CPU, a Qwen3-MoE whose layers were all
    checkpointed compiled no graph at all, and compiled one per layer with this setting, to the same losses. What
    the wrapper sets it restores before the forward returns, so a recomputation that leaves it alone is the same."""
    import torch._dynamo.config as dynamo
    import torch._inductor.config as inductor

    if hasattr(inductor, "emulate_precision_casts"):
        inductor.emulate_precision_casts = numerics == "eager"
    if hasattr(dynamo, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        dynamo.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def graph_breaks(shown: int = 2) -> str | None:
    """model.compile's graph breaks in this process so far, as one line, or None: each is code that ran uncompiled
    between the layer's graphs (a checkpointed layer torch refused ran uncompiled whole), which nothing said. The
    most frequent reasons first, each by the first line of torch's own explanation."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return None
    breaks = counters.get("graph_break") or {}
    if not breaks:
        return None
    reasons = [reason.strip().splitlines()[0][:160] for reason, _ in
               sorted(breaks.items(), key=lambda item: -item[1])[:shown]]
    more = f"; {len(breaks) - shown} other reason(s)" if len(breaks) > shown else ""
    return (f"model.compile: {sum(breaks.values())} graph break(s) by the first step, so parts of the layers run "
            f"uncompiled: {'; '.join(reasons)}{more} (TORCH_LOGS=graph_breaks shows where)")


def _left_out(model: nn.Module, mesh, sharded: list[nn.Parameter], replicated: bool) -> dict:
    """fully_shard's arguments that leave out of FSDP the experts each rank holds itself (expert parallelism),
    and, when the layout replicates the base (or on a one-rank mesh), every frozen weight: FSDP would copy every
    weight into its unsharded buffer for each forward and each backward (a 30B model: about 120 GB of device
    copies per step) and all-gather it on several ranks. The adapters stay FSDP's (mixed precision, the
    checkpoint code's DTensors). A torch whose fully_shard has no ignored_params (before 2.7) keeps them all in,
    and cannot shard experts."""
    import inspect

    from torch.distributed.fsdp import fully_shard

    if "ignored_params" not in inspect.signature(fully_shard).parameters:
        if sharded:
            raise ConfigError(f"model.parallelism: expert layouts need torch >= 2.7 (FSDP's ignored_params); this "
                              f"node has {torch.__version__}")
        return {}
    left = set(sharded)
    if replicated or mesh.size() == 1:
        left |= {p for p in model.parameters() if not p.requires_grad}
    return {"ignored_params": left} if left else {}


@dataclass(frozen=True)
class Parallel:
    """What `parallelize` decided, handed to the code after it (loading, parameter counts, checkpoints, the traffic
    count) as a value: nothing of it is kept on the model."""

    layout: Any = None         # the layout it was wrapped for (trainer/layout.py: Layout); None without one
    shape: Any = None          # the model's shape that layout was chosen for (layout.Shape)
    grouped: int = 0           # fused experts modules on the grouped LoRA path
    peft_path: tuple[str, ...] = ()   # those left on peft's path, and why
    # expert layouts: a fused expert weight's name -> (first expert held, last + 1, full shape)
    experts: Mapping[str, tuple[int, int, tuple[int, ...]]] = field(default_factory=dict)
    lora_kernel: str = ""      # the grouped path's adapter products: triton or torch (model.expert_lora_kernel)


def parallelize(model: nn.Module, recipe: Recipe, mesh, bf16: bool, layout=None, experts_over=None,
                shape=None) -> Parallel:
    """The wrapping order, in one place: LoRA (already applied), the routed experts' grouped path
    (model.moe_kernel) and their split over `experts_over` (group, rank in it, size: the layout's expert group),
    activation checkpointing, compile, FSDP2 over `mesh` (1-D, or 2-D replicate x shard: HSDP). The model is
    wrapped in place; what was decided comes back.

    Compilation covers each decoder layer's forward and nothing else: FSDP's hooks stay outside the compiled
    code and parameter names stay as they are. One FSDP unit per decoder layer, then the root; with torch < 2.8
    the fp32 adapters of a layer get a unit of their own beside the bf16 base."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    sharded, experts, grouped, peft_path, lora_kernel = [], {}, 0, [], ""
    if recipe.model.moe_kernel == "grouped":
        from . import moe

        lora_kernel = moe.lora_kernel(recipe.model.expert_lora_kernel)
        grouped, peft_path = moe.install(model, lora_kernel)
        if experts_over is not None:
            sharded, experts = moe.shard_experts(model, *experts_over,
                                                 in_graph=recipe.model.expert_exchange == "graph")
    layers = decoder_layers(model)
    for index in checkpointed_layers(len(layers), recipe.model.activation_checkpointing):
        _checkpoint_forward(layers[index])
    separate_adapters = len({p.dtype for p in model.parameters()}) > 1 and not _fsdp_takes_mixed_frozen_dtypes()
    left_out = _left_out(model, mesh, sharded, layout is not None and not layout.frozen_sharded)
    if recipe.model.compile:
        compile_settings(recipe.model.compile_numerics)
    for layer in layers:
        if recipe.model.compile:
            layer.forward = torch.compile(layer.forward)
        if separate_adapters:
            fully_shard(_adapter_linears(layer), mesh=mesh, mp_policy=policy)
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=recipe.model.reshard_after_forward,
                    **left_out)
    if separate_adapters:
        inside = {id(m) for layer in layers for m in layer.modules()}
        rest = [m for m in _adapter_linears(model) if id(m) not in inside]
        if rest:
            fully_shard(rest, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False, **left_out)
    from . import loss

    loss.attach(model)
    return Parallel(layout, shape, grouped, tuple(peft_path), experts, lora_kernel)


def _lora_init(name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor | None:
    """A LoRA weight at full size as peft starts it (A: Kaiming-uniform, as nn.Linear does; B: zeros), or None
    for a base weight. Drawn in state_dict order from one seeded stream, so every loading path builds the same
    adapters."""
    if ".lora_A." in name:
        bound = 1 / math.sqrt(shape[1])  # kaiming_uniform_(a=sqrt(5)), also for an expert stack's (E*r, in) A
        return torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
    if ".lora_B." in name:
        return torch.zeros(shape, dtype=torch.float32)
    return None


def _checkpoint_name(name: str, checkpoint: Checkpoint) -> str:
    key = hf_name(name)
    if key not in checkpoint and key == "lm_head.weight":
        key = "model.embed_tokens.weight"  # tied embeddings
    return key


def full_state_for_rank0(model: nn.Module, model_path: Path, seed: int) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer at full size, on the CPU: the checkpoint's base weights (experts
    assembled as transformers builds them), and the adapters initialised as peft does."""
    checkpoint = Checkpoint(model_path, model)
    generator = torch.Generator().manual_seed(seed)
    state = {}
    try:
        for name, value in model.state_dict().items():
            lora = _lora_init(name, value.shape, generator)
            if lora is None:
                lora = checkpoint.rows(_checkpoint_name(name, checkpoint), 0, value.shape[0] if value.dim() else 0,
                                       tuple(value.shape))
            state[name] = lora.to(value.dtype)
    finally:
        checkpoint.close()
    return state


def materialise(model: nn.Module, model_path: Path, device: torch.device, rank: int, seed: int) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = full_state_for_rank0(model, model_path, seed) if rank == 0 else {}
    model.to_empty(device=device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    _reset_rotary(model, device)


def _rows(param) -> tuple[int, int]:
    """The rows of dim 0 this rank holds: for FSDP's DTensor, from its mesh and placements (dim 0 split as
    torch.chunk does over the shard dimension, whole over a replicate one); a plain tensor holds them all."""
    if not param.dim():
        return 0, 0
    if not hasattr(param, "device_mesh"):
        return 0, param.shape[0]
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return offset[0], offset[0] + local[0]


def materialise_sliced(model: nn.Module, model_path: Path, device: torch.device, seed: int,
                       experts: Mapping = NO_EXPERTS) -> None:
    """model.load: sliced. Each rank reads only the rows of its own shards, straight from the node's copy of the
    checkpoint (safetensors slices of a memory map; for a fused expert weight, only its own experts' tensors):
    host memory stays near one weight's shard, not the model, and no weight crosses the network. LoRA weights
    start as on the broadcast path, so both paths give the same model. `experts`: Parallel.experts."""
    checkpoint = Checkpoint(model_path, model)
    generator = torch.Generator().manual_seed(seed)
    model.to_empty(device=device)
    try:
        with torch.no_grad():
            for name, param in model.state_dict().items():
                local = param.to_local() if hasattr(param, "to_local") else param
                start, stop = _rows(param)
                shape = tuple(param.shape)
                if name in experts:
                    start, stop, shape = experts[name]
                full = _lora_init(name, param.shape, generator)  # drawn at full size, as the broadcast path does
                if full is None:
                    full = checkpoint.rows(_checkpoint_name(name, checkpoint), start, stop, shape)
                elif param.dim():
                    full = full[start:stop]
                local.copy_(full.to(local.dtype))
    finally:
        checkpoint.close()
    _reset_rotary(model, device)


def materialise_random(model: nn.Module, device: torch.device, seed: int, experts: Mapping = NO_EXPERTS) -> None:
    """model.init: random, for benchmarks at any size: each rank fills only its own shards on its device (no
    checkpoint file, no host copy, no broadcast). Base weights N(0, 0.02), norms 1, LoRA A Kaiming-uniform and B
    zeros as peft starts them. Each piece is drawn from a stream seeded by its parameter and its first row, so
    ranks that hold the same piece (a replicated base, HSDP's replicas, the same experts on two nodes) hold the
    same values; the model differs with the layout."""
    model.to_empty(device=device)
    generator = torch.Generator(device=device)
    with torch.no_grad():
        for index, (name, param) in enumerate(model.named_parameters()):
            local = param.to_local() if hasattr(param, "to_local") else param
            first = experts[name][0] if name in experts else _rows(param)[0]
            generator.manual_seed((seed * 1_000_003 + index) * 1_000_003 + first)
            if ".lora_B." in name:
                local.zero_()
            elif ".lora_A." in name:
                bound = 1 / math.sqrt(param.shape[1])
                local.uniform_(-bound, bound, generator=generator)
            elif "norm" in name:
                local.fill_(1.0)
            else:
                local.normal_(0.0, 0.02, generator=generator)
    _reset_rotary(model, device)


def _reset_rotary(model: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (rotary inverse frequencies) are not in any checkpoint: compute them again."""
    for module in model.modules():
        if "RotaryEmbedding" in type(module).__name__ and hasattr(module, "inv_freq"):
            with torch.device(device):  # transformers 4.x takes device=, 5.x does not: the context covers both
                fresh = type(module)(config=module.config)
            for name, buffer in fresh.named_buffers(recurse=False):
                setattr(module, name, buffer.to(device))


def _full_shapes(model: nn.Module, experts: Mapping) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape at full size (a rank's expert-parallel shard counted as its whole stack)."""
    return {name: experts[name][2] if name in experts else tuple(p.shape) for name, p in model.named_parameters()}


def parameter_counts(model: nn.Module, experts: Mapping = NO_EXPERTS) -> tuple[int, int]:
    """(trainable, frozen) parameters at full size (`experts`: Parallel.experts, where a rank holds a part)."""
    shapes = _full_shapes(model, experts)
    trainable = sum(math.prod(shapes[n]) for n, p in model.named_parameters() if p.requires_grad)
    frozen = sum(math.prod(shapes[n]) for n, p in model.named_parameters() if not p.requires_grad)
    return trainable, frozen
