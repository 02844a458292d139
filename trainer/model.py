"""Building the model: meta-device construction, LoRA (peft), activation checkpointing, FSDP2, and loading the
real weights: each rank reads its own shards from its node's copy (model.load: sliced), or rank 0 reads them
all and hands each rank its shards (model.load: broadcast)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from .config import ConfigError, Recipe


def build_skeleton(recipe: Recipe, model_path: Path, dtype: torch.dtype) -> nn.Module:
    """The model with LoRA, on the meta device: no memory, no collectives, so a bad recipe fails everywhere
    at once before any process group exists."""
    import peft
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.to(dtype)
    lora = peft.LoraConfig(r=recipe.lora.r, lora_alpha=recipe.lora.alpha, lora_dropout=recipe.lora.dropout,
                           target_modules=list(recipe.lora.target_modules), task_type="CAUSAL_LM")
    try:
        model = peft.get_peft_model(model, lora)
    except ValueError as exc:
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ConfigError(f"lora.target_modules: {list(recipe.lora.target_modules)} matches no module of the "
                          f"model ({exc.__class__.__name__}); its linear layers are {linear}") from None
    for name, param in model.named_parameters():
        if param.requires_grad:
            param.data = param.data.to(torch.float32)  # adapters train in fp32; the frozen base stays in dtype
    return model


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


def _set_compile_numerics(mode: str) -> None:
    """Fused kernels keep fp32 between operations that eager PyTorch rounds to bf16 one by one. That is more
    precise, but early LoRA updates (far below the bf16 resolution of the frozen layer's output, which eager
    rounds them into) then move the loss sooner than eager does: measured on the 8B bench, up to 2% lower loss
    in steps 2-10, the same curve after. "eager" makes Inductor round where eager does, for the same curve."""
    import torch._inductor.config as inductor

    if hasattr(inductor, "emulate_precision_casts"):
        inductor.emulate_precision_casts = mode == "eager"


def parallelize(model: nn.Module, recipe: Recipe, mesh, bf16: bool) -> nn.Module:
    """The wrapping order, in one place: LoRA (already applied), activation checkpointing, compile, FSDP2.

    Compilation covers each decoder layer's forward and nothing else: FSDP's hooks stay outside the compiled
    code and parameter names stay as they are. One FSDP unit per decoder layer, then the root; with torch < 2.8
    the fp32 adapters of a layer get a unit of their own beside the bf16 base."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    layers = decoder_layers(model)
    for index in checkpointed_layers(len(layers), recipe.model.activation_checkpointing):
        _checkpoint_forward(layers[index])
    separate_adapters = len({p.dtype for p in model.parameters()}) > 1 and not _fsdp_takes_mixed_frozen_dtypes()
    if recipe.model.compile:
        _set_compile_numerics(recipe.model.compile_numerics)
    for layer in layers:
        if recipe.model.compile:
            layer.forward = torch.compile(layer.forward)
        if separate_adapters:
            fully_shard(_adapter_linears(layer), mesh=mesh, mp_policy=policy)
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=recipe.model.reshard_after_forward)
    if separate_adapters:
        inside = {id(m) for layer in layers for m in layer.modules()}
        rest = [m for m in _adapter_linears(model) if id(m) not in inside]
        if rest:
            fully_shard(rest, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    from . import loss

    loss.attach(model)
    return model


def _checkpoint_tensors(model_path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = model_path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    tensors = {}
    for name in files:
        tensors.update(load_file(str(model_path / name)))
    return tensors


def hf_name(param_name: str) -> str:
    """peft's parameter name -> the name in the model's own checkpoint."""
    name = param_name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def full_state_for_rank0(model: nn.Module, model_path: Path, seed: int) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer at full size, on the CPU: the checkpoint's base weights, and the
    adapters initialised as peft does (A: Kaiming-uniform, B: zeros) from a seeded generator."""
    tensors = _checkpoint_tensors(model_path)
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, value in model.state_dict().items():
        shape, dtype = value.shape, value.dtype
        if ".lora_A." in name:
            weight = torch.empty(shape, dtype=torch.float32)
            bound = 1 / math.sqrt(shape[1])  # kaiming_uniform_(a=sqrt(5)) as nn.Linear and peft use
            state[name] = weight.uniform_(-bound, bound, generator=generator).to(dtype)
        elif ".lora_B." in name:
            state[name] = torch.zeros(shape, dtype=dtype)
        else:
            key = hf_name(name)
            if key not in tensors and key == "lm_head.weight":
                key = "model.embed_tokens.weight"  # tied embeddings
            if key not in tensors:
                raise ConfigError(f"model.path: {model_path} has no weight {key!r}")
            state[name] = tensors[key].to(dtype)
    return state


def materialise(model: nn.Module, model_path: Path, device: torch.device, rank: int, seed: int) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = full_state_for_rank0(model, model_path, seed) if rank == 0 else {}
    model.to_empty(device=device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    _reset_rotary(model, device)


def checkpoint_files(model_path: Path) -> dict[str, Path]:
    """Weight name -> the safetensors file that holds it, from the index (or the one model.safetensors)."""
    index = model_path / "model.safetensors.index.json"
    if index.exists():
        return {name: model_path / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    single = model_path / "model.safetensors"
    if not single.exists():
        raise ConfigError(f"model.path: {model_path} has no model.safetensors or model.safetensors.index.json on "
                          f"this node (model.load: sliced reads each node's own copy; model.load: broadcast reads "
                          f"the weights on rank 0 only)")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as handle:
        return {name: single for name in handle.keys()}


def _rows(param, world: int, rank: int) -> tuple[int, int]:
    """The rows of dim 0 this rank holds: FSDP2 shards dim 0 as torch.chunk does (ceil-sized chunks, the last ones
    shorter or empty)."""
    chunk = -(-param.shape[0] // world) if param.dim() else 0
    start = min(rank * chunk, param.shape[0]) if param.dim() else 0
    return start, min(start + chunk, param.shape[0]) if param.dim() else 0


def materialise_sliced(model: nn.Module, model_path: Path, device: torch.device, rank: int, world: int,
                       seed: int) -> None:
    """model.load: sliced. Each rank reads only the rows of its own shards, straight from the node's copy of the
    checkpoint (safetensors slices of a memory map): host memory stays near one weight's shard, not the model,
    and no weight crosses the network. LoRA weights start as peft starts them, from the same seeded stream as
    the broadcast path, so both paths give the same model."""
    from safetensors import safe_open

    files = checkpoint_files(model_path)
    handles: dict[Path, object] = {}
    generator = torch.Generator().manual_seed(seed)
    model.to_empty(device=device)
    try:
        with torch.no_grad():
            for name, param in model.state_dict().items():
                local = param.to_local() if hasattr(param, "to_local") else param
                sharded = hasattr(param, "to_local")
                start, stop = _rows(param, world, rank) if sharded else (0, param.shape[0] if param.dim() else 0)
                if ".lora_A." in name:  # drawn at full size in state_dict order, as the broadcast path does
                    bound = 1 / math.sqrt(param.shape[1])
                    full = torch.empty(param.shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
                    local.copy_(full[start:stop] if param.dim() else full)
                    continue
                if ".lora_B." in name:
                    local.zero_()
                    continue
                key = hf_name(name)
                if key not in files and key == "lm_head.weight":
                    key = "model.embed_tokens.weight"  # tied embeddings
                if key not in files:
                    raise ConfigError(f"model.path: {model_path} has no weight {key!r}")
                handle = handles.get(files[key])
                if handle is None:
                    handle = handles[files[key]] = safe_open(str(files[key]), framework="pt")
                piece = handle.get_slice(key)
                rows = piece[start:stop] if param.dim() else piece[:]
                if tuple(rows.shape) != tuple(local.shape):
                    raise ConfigError(f"model.path: {key} has shape {piece.get_shape()}, the model expects "
                                      f"{list(param.shape)}")
                local.copy_(rows.to(local.dtype))
    finally:
        handles.clear()
    _reset_rotary(model, device)


def materialise_random(model: nn.Module, device: torch.device, rank: int, seed: int) -> None:
    """model.init: random, for benchmarks at any size: each rank fills only its own shards on its device (no
    checkpoint file, no host copy, no broadcast). Base weights N(0, 0.02), norms 1, LoRA A Kaiming-uniform and B
    zeros as peft starts them. Ranks draw from their own seeded streams, so the model differs with world size."""
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + rank)
    with torch.no_grad():
        for name, param in model.named_parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
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


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, frozen) parameters at full size."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return trainable, frozen
