"""Exports of a trained adapter, beside the PEFT adapter the trainer always writes:

- merged: the base model with the adapter folded in, as Hugging Face safetensors that transformers loads on its
  own (peft's merge_and_unload, then save_pretrained, which writes the checkpoint's own layout: one tensor per
  expert on a Mixture-of-Experts model). It holds the whole model in host memory, in the checkpoint's dtype.
- vllm: the adapter with every LoRA module named as in the base checkpoint, as vLLM's LoRA loader reads adapters.
  A fused expert weight's adapter (peft's target_parameters: one (experts*r, in) A and one (out, r*experts) B)
  becomes per-expert modules (experts.3.gate_proj, experts.3.up_proj, ...) with the same products B_e @ A_e.
  vLLM scales every module by one lora_alpha / r: the config gets the largest module rank and the alpha that
  keeps the trained alpha/r, and a module trained at another scale (lora.expert_r) has its own folded into B.

    python -m trainer.export ADAPTER --model MODEL_DIR [--merged OUT] [--vllm OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from .config import ConfigError
from .model import peft_false_alarms
from .weights import Checkpoint, hf_name


def _fresh(out: Path) -> Path:
    """A sibling temporary folder for `out`, renamed into place when complete."""
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _publish(tmp: Path, out: Path) -> Path:
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def export_merged(model_path: Path, adapter: Path, out: Path) -> Path:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype="auto")
    with peft_false_alarms():
        merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    tmp = _fresh(out)
    merged.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(tmp)
    return _publish(tmp, out)


def _lora_layers(model_path: Path, adapter: Path):
    """peft's LoRA layers of the model on the meta device (no weights), built from the adapter's own config:
    (module name, layer) pairs, the layer telling what it adapts."""
    import peft
    from peft.tuners.lora.layer import LoraLayer
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    with peft_false_alarms():
        model = peft.get_peft_model(model, peft.LoraConfig.from_pretrained(str(adapter)))
    return model, [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]


def vllm_tensors(model_path: Path, adapter: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The adapter's tensors in checkpoint names, fused experts split per expert, and its vLLM config."""
    from peft.tuners.lora.layer import ParamWrapper
    from safetensors.torch import load_file

    config = json.loads((adapter / "adapter_config.json").read_text())
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    model, layers = _lora_layers(model_path, adapter)
    checkpoint = Checkpoint(model_path, model)
    scale = config["lora_alpha"] / config["r"]
    tensors: dict[str, torch.Tensor] = {}
    modules: set[str] = set()
    try:
        for name, layer in layers:
            a, b = saved.pop(f"{name}.lora_A.weight"), saved.pop(f"{name}.lora_B.weight")
            b = b * (layer.scaling["default"] / scale)  # one scale for every module, as vLLM applies it
            if isinstance(layer, ParamWrapper) and layer.num_experts > 1:
                if not layer._did_swap_in_out_features:
                    raise ConfigError(f"{name}: experts stored (experts, in, out); vLLM's per-expert layout is "
                                      f"written for (experts, out, in) weights only")
                weight = hf_name(f"{name}.{layer.parameter_name}")
                experts = checkpoint.expert_modules(weight)
                if experts is None:
                    raise ConfigError(f"{weight}: the checkpoint stores it fused; vLLM's per-expert layout needs "
                                      f"the per-expert names of a Hub checkpoint")
                count, rank = layer.num_experts, a.shape[0] // layer.num_experts
                a_e = a.reshape(count, rank, -1)
                b_e = b.reshape(b.shape[0], rank, count)
                for e, parts in enumerate(experts):
                    for part, rows in zip(parts, b_e[:, :, e].chunk(len(parts), dim=0)):
                        tensors[f"base_model.model.{part}.lora_A.weight"] = a_e[e].clone()  # one A per module
                        tensors[f"base_model.model.{part}.lora_B.weight"] = rows.clone()
                        modules.add(part.rsplit(".", 1)[-1])
            else:
                part = checkpoint.source_keys(hf_name(f"{name}.weight"))[0].removesuffix(".weight")
                tensors[f"base_model.model.{part}.lora_A.weight"] = a
                tensors[f"base_model.model.{part}.lora_B.weight"] = b
                modules.add(part.rsplit(".", 1)[-1])
    finally:
        checkpoint.close()
    if saved:
        raise ConfigError(f"{adapter}: tensors that are not LoRA A/B pairs ({sorted(saved)[:3]}): vLLM loads none")
    for key in ("target_parameters", "rank_pattern", "alpha_pattern"):
        config.pop(key, None)
    config["target_modules"] = sorted(modules)
    # One rank and alpha for every module, as vLLM reads them: the largest rank (fused experts have n*r) and the
    # alpha that keeps alpha/r, the scale already folded into each module's B.
    top = max(t.shape[0] for k, t in tensors.items() if k.endswith(".lora_A.weight"))
    alpha = scale * top
    config["r"], config["lora_alpha"] = top, int(alpha) if float(alpha).is_integer() else alpha
    return tensors, config


def export_vllm(model_path: Path, adapter: Path, out: Path) -> Path:
    from safetensors.torch import save_file

    tensors, config = vllm_tensors(model_path, adapter)
    tmp = _fresh(out)
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    return _publish(tmp, out)


def export_after_training(recipe) -> None:
    """train.export: the run's final adapter, exported on rank 0 into the output folder."""
    import time

    from .config import exports
    from .loop import resolve_paths

    model_path, _ = resolve_paths(recipe)
    out_dir, adapter = recipe.output_dir(), recipe.output_dir() / "adapter"
    for kind in exports(recipe):
        started = time.perf_counter()
        path = export_merged(model_path, adapter, out_dir / "merged") if kind == "merged" else \
            export_vllm(model_path, adapter, out_dir / "adapter-vllm")
        print(f"exported {kind} to {path} in {time.perf_counter() - started:.1f}s", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("adapter", type=Path, help="a PEFT adapter folder (output/adapter)")
    parser.add_argument("--model", type=Path, required=True, help="the base model folder it was trained on")
    parser.add_argument("--merged", type=Path, help="write the merged model here")
    parser.add_argument("--vllm", type=Path, help="write the vLLM-layout adapter here")
    args = parser.parse_args(argv)
    if not (args.merged or args.vllm):
        parser.error("nothing to do: give --merged OUT and/or --vllm OUT")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        if not (args.adapter / "adapter_config.json").is_file():
            raise ConfigError(f"{args.adapter}: no adapter_config.json (expected a PEFT adapter folder)")
        if not (args.model / "config.json").is_file():
            raise ConfigError(f"--model {args.model}: no config.json (expected a Hugging Face model folder)")
        if args.vllm:
            print(f"vLLM adapter: {export_vllm(args.model, args.adapter, args.vllm)}")
        if args.merged:
            print(f"merged model: {export_merged(args.model, args.adapter, args.merged)}")
    except ConfigError as exc:
        print(f"export error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
