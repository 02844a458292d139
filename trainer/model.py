"""Building the model: meta-device construction, LoRA (peft), activation checkpointing, FSDP2, and loading the
real weights once from disk on rank 0 and handing each rank only its shards."""
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


def parallelize(model: nn.Module, recipe: Recipe, mesh, bf16: bool) -> nn.Module:
    """The wrapping order, in one place: LoRA (already applied), activation checkpointing, compile, FSDP2.

    Activation checkpointing is non-reentrant: the reentrant kind re-runs forward hooks and is what makes DDP
    report "marked ready twice". Where a block mixes the frozen bf16 base with fp32 adapters, the adapters of the
    block get their own FSDP unit (FSDP2 all-gathers one dtype per unit)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if recipe.model.activation_checkpointing:
        model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        if recipe.model.compile:
            layer.compile()
        dtypes = {p.dtype for p in layer.parameters()}
        if len(dtypes) > 1:
            fully_shard(_adapter_linears(layer), mesh=mesh, mp_policy=policy)
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    if len({p.dtype for p in model.parameters()}) > 1:
        inside = {id(m) for layer in decoder_layers(model) for m in layer.modules()}
        rest = [m for m in _adapter_linears(model) if id(m) not in inside]
        if rest:
            fully_shard(rest, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
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
