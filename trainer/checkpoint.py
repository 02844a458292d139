"""Adapter checkpoints in PEFT format. Only the LoRA parameters are gathered (their shards are small); the
frozen base is never all-gathered, which is what made adapter saves take 30 minutes and time out elsewhere."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def gather_adapter(model: nn.Module) -> tuple[dict[str, torch.Tensor], int]:
    """Full LoRA tensors on rank 0 (empty elsewhere) and the number of bytes that were gathered.
    Every rank must call this: each full_tensor() is a collective."""
    rank = dist.get_rank()
    state, gathered = {}, 0
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        full = param.full_tensor() if hasattr(param, "full_tensor") else param.detach()
        gathered += full.numel() * full.element_size()
        if rank == 0:
            state[name] = full.detach().to("cpu", torch.float32).clone()
    return state, gathered


def save_adapter(model: nn.Module, out_dir: Path, step: int, keep_last: int) -> dict:
    """adapter_config.json + adapter_model.safetensors under out_dir/adapter-<step>, written aside and renamed,
    then `adapter` pointing at the newest; older ones beyond keep_last are removed."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    started = time.perf_counter()
    state, gathered = gather_adapter(model)
    info = {"step": step, "gathered_bytes": gathered, "tensors": len(state),
            "gather_seconds": round(time.perf_counter() - started, 3)}
    if dist.get_rank() == 0:
        # the LoRA tensors alone (an adapter on the embeddings included); no base embedding weights to add
        peft_state = get_peft_model_state_dict(model, state_dict=state, save_embedding_layers=False)
        final = out_dir / f"adapter-{step:07d}"
        tmp = out_dir / f".adapter-{step:07d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        model.peft_config["default"].save_pretrained(str(tmp))
        save_file({k: v.contiguous() for k, v in peft_state.items()}, str(tmp / "adapter_model.safetensors"),
                  metadata={"format": "pt", "step": str(step)})
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest = out_dir / "adapter"
        tmp_link = out_dir / ".adapter.link"
        tmp_link.unlink(missing_ok=True)
        tmp_link.symlink_to(final.name)
        os.replace(tmp_link, latest)
        for old in sorted(out_dir.glob("adapter-*"))[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        info["path"] = str(final)
        info["tensors"] = len(peft_state)
    info["seconds"] = round(time.perf_counter() - started, 3)
    return info
