"""Reading a Hugging Face checkpoint by rows, in the names and shapes of the model transformers builds.

A checkpoint may hold a weight under another name, or in pieces: a Mixture-of-Experts checkpoint on the Hub keeps
one tensor per expert and projection (`mlp.experts.3.gate_proj.weight`), while transformers 5 builds one fused
3-D parameter per projection pair (`mlp.experts.gate_up_proj`, experts first). transformers describes that
relation in its conversion mapping (WeightRenaming, WeightConverter); this module reads the mapping rather than
restating it, and assembles only the rows a rank asks for: the experts of its FSDP shard, one file slice each."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .config import ConfigError


def checkpoint_files(model_path: Path) -> dict[str, Path]:
    """Checkpoint key -> the safetensors file that holds it, from the index (or the one model.safetensors)."""
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


def hf_name(param_name: str) -> str:
    """peft's parameter name -> the model's own: no `base_model.model.` prefix and no `.base_layer` levels (a
    fused expert weight with LoRA on two of its parameters sits two ParamWrappers deep)."""
    return re.sub(r"\.base_layer(?=\.)", "", param_name.removeprefix("base_model.model."))


@dataclass
class _Stacked:
    """A weight transformers builds from per-expert tensors: stacked over experts (MergeModulelist, dim 0), then,
    for several source patterns (gate and up), concatenated along dim 1 in the converter's order."""
    converter: object
    parts: dict[str, dict[int, str]] = field(default_factory=dict)  # source pattern -> expert -> checkpoint key


def _stacking_ops(converter) -> str | None:
    """None when the converter only stacks experts (and concatenates projections), else a description of what it
    does that this reader does not."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(getattr(converter, "operations", []))
    if ops and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0 and all(
            isinstance(op, Concatenate) and op.dim == 1 for op in ops[1:]) and len(ops) <= 2:
        return None
    return ", ".join(repr(op) for op in ops) or "no operation"


class Checkpoint:
    """The checkpoint at `model_path`, addressed by the model's parameter names."""

    def __init__(self, model_path: Path, model: nn.Module) -> None:
        self.path = model_path
        self.files = checkpoint_files(model_path)
        self.direct: dict[str, str] = {}
        self.stacked: dict[str, _Stacked] = {}
        self._handles: dict[Path, object] = {}
        renamings, converters = _conversions(model)
        for key in self.files:  # as transformers renames: every renaming in turn, then the first converter
            renamed = key
            for renaming in renamings:
                renamed = renaming.rename_source_key(renamed)[0]
            target, pattern, converter = renamed, None, None
            for converter in converters:
                target, pattern = converter.rename_source_key(renamed)
                if pattern is not None:
                    break
            if pattern is None:
                self.direct[renamed] = key
                continue
            expert = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), renamed)
            entry = self.stacked.setdefault(target, _Stacked(converter))
            entry.parts.setdefault(pattern, {})[int(expert.group(1)) if expert else 0] = key

    def __contains__(self, name: str) -> bool:
        return name in self.direct or name in self.stacked

    def close(self) -> None:
        self._handles.clear()

    def _slice(self, key: str):
        file = self.files[key]
        handle = self._handles.get(file)
        if handle is None:
            from safetensors import safe_open

            handle = self._handles[file] = safe_open(str(file), framework="pt")
        return handle.get_slice(key)

    def source_keys(self, name: str) -> list[str]:
        """The checkpoint keys a model weight is read from (several for stacked experts)."""
        if name in self.direct:
            return [self.direct[name]]
        entry = self.stacked[name]
        return [entry.parts[p][e] for p in entry.converter.source_patterns for e in sorted(entry.parts.get(p, {}))]

    def expert_modules(self, name: str) -> list[list[str]] | None:
        """For a stacked weight, the checkpoint's module name of each part of each expert
        ([[experts.0.gate_proj, experts.0.up_proj], ...]); None for a weight stored whole."""
        entry = self.stacked.get(name)
        if entry is None:
            return None
        patterns = entry.converter.source_patterns
        count = len(entry.parts[patterns[0]])
        return [[entry.parts[p][e].removesuffix(".weight") for p in patterns] for e in range(count)]

    def rows(self, name: str, start: int, stop: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Rows start:stop of dim 0 of the model weight `name` (the whole of a 0-dim weight), as stored."""
        if name not in self:
            raise ConfigError(f"model.path: {self.path} has no weight {name!r}")
        if name in self.direct:
            piece = self._slice(self.direct[name])
            got = piece[start:stop] if len(shape) else piece[:]
            stored = piece.get_shape()
        else:
            entry = self.stacked[name]
            unsupported = _stacking_ops(entry.converter)
            if unsupported:
                raise ConfigError(f"model.path: {name} is built by transformers with {unsupported}, which nodectl's "
                                  f"weight reader does not read (it reads stacked experts)")
            patterns = entry.converter.source_patterns
            missing = [p for p in patterns if sorted(entry.parts.get(p, {})) != list(range(shape[0]))]
            if missing:
                raise ConfigError(f"model.path: {name} needs {shape[0]} experts of {', '.join(missing)}; the "
                                  f"checkpoint has {len(entry.parts.get(missing[0], {}))}")
            parts = [torch.stack([self._slice(entry.parts[p][e])[:] for e in range(start, stop)])
                     if stop > start else None for p in patterns]
            got = torch.cat(parts, dim=1) if stop > start else torch.empty((0, *shape[1:]))
            first = self._slice(entry.parts[patterns[0]][0]).get_shape()
            stored = [shape[0], first[0] * len(patterns), *first[1:]]
        expected = (stop - start, *shape[1:]) if len(shape) else ()
        if tuple(got.shape) != tuple(expected):
            raise ConfigError(f"model.path: {name} has shape {list(stored)}, the model expects {list(shape)}")
        return got


def expert_fusions(model: nn.Module) -> dict[str, list[str]]:
    """Fused expert weight -> the per-expert projections transformers builds it from, by leaf name
    (gate_up_proj -> [gate_proj, up_proj]; Mixtral's -> [w1, w3]; down_proj -> [down_proj])."""
    fusions = {}
    for converter in _conversions(model)[1]:
        if _stacking_ops(converter) is None:
            leaves = [pattern.removesuffix(".weight").rsplit(".", 1)[-1] for pattern in converter.source_patterns]
            fusions[converter.target_patterns[0].rsplit(".", 1)[-1]] = leaves
    return fusions


def _conversions(model: nn.Module) -> tuple[list, list]:
    """transformers' renamings and converters for this model (none for a transformers without the mapping)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return [], []
    hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model  # under peft's wrapper
    conversions = get_model_conversion_mapping(hf_model)
    return ([c for c in conversions if isinstance(c, WeightRenaming)],
            [c for c in conversions if isinstance(c, WeightConverter)])
