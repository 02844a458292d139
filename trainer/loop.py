"""The training loop. Every collective is called by every rank, in the same order; what is logged is reduced
across ranks only at the logging interval, so steps in between never wait on the host."""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import checkpoint, demo
from .config import ConfigError, Recipe
from .data import IGNORE, StepBatches, load_examples
from .metrics import Reporter, flops_per_token, peak_flops
from .model import build_skeleton, materialise, parallelize, parameter_counts


@dataclass
class Context:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    on_gpu: bool


def distributed_context() -> Context:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    on_gpu = torch.cuda.is_available() and os.environ.get("NODECTL_DEVICE", "") != "cpu"
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    return Context(rank, world, local_rank, device, on_gpu)


def resolve_paths(recipe: Recipe) -> tuple[Path, Path]:
    model_path = Path(os.path.expanduser(recipe.model.path)) if recipe.model.path != "demo" else None
    data_path = Path(os.path.expanduser(recipe.data.path)) if recipe.data.path != "demo" else None
    if model_path is None or data_path is None:
        demo_model, demo_data = demo.ensure_demo()
        model_path, data_path = model_path or demo_model, data_path or demo_data
    return model_path, data_path


def chunked_loss_sum(logits: torch.Tensor, labels: torch.Tensor, chunk_rows: int = 4096) -> torch.Tensor:
    """Summed next-token cross-entropy, upcasting to fp32 one chunk of rows at a time, not the whole batch."""
    logits = logits[:, :-1].reshape(-1, logits.size(-1))
    targets = labels[:, 1:].reshape(-1)
    total = logits.new_zeros((), dtype=torch.float32)
    for start in range(0, targets.numel(), chunk_rows):
        total = total + F.cross_entropy(logits[start:start + chunk_rows].float(), targets[start:start + chunk_rows],
                                        ignore_index=IGNORE, reduction="sum")
    return total


def lr_at(step: int, recipe: Recipe) -> float:
    warmup, total, peak = recipe.train.warmup_steps, recipe.train.steps, recipe.train.lr
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(recipe: Recipe) -> dict:
    ctx = distributed_context()
    dtype = torch.bfloat16 if (recipe.model.dtype == "bfloat16" or (recipe.model.dtype == "auto" and ctx.on_gpu)) \
        else torch.float32
    model_path, data_path = resolve_paths(recipe)
    model = build_skeleton(recipe, model_path, dtype)  # raises ConfigError on every rank alike
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    examples = load_examples(data_path, tokenizer, recipe.data.max_length, recipe.data.packing)
    dist.init_process_group("nccl" if ctx.on_gpu else "gloo", device_id=ctx.device if ctx.on_gpu else None,
                            timeout=timedelta(seconds=recipe.train.collective_timeout_s))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    torch.manual_seed(recipe.train.seed)
    model = parallelize(model, recipe, mesh, dtype == torch.bfloat16)
    materialise(model, model_path, ctx.device, ctx.rank, recipe.train.seed)
    out_dir = recipe.output_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    return _loop(recipe, ctx, model, examples, tokenizer, out_dir)


def _loop(recipe: Recipe, ctx: Context, model, examples, tokenizer, out_dir: Path) -> dict:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=recipe.train.lr, weight_decay=recipe.train.weight_decay,
                                  betas=(0.9, 0.95), fused=ctx.on_gpu or None)
    batches = StepBatches(examples, micro_batch_size=recipe.train.micro_batch_size,
                          grad_accum=recipe.train.grad_accum, world_size=ctx.world, rank=ctx.rank,
                          seed=recipe.data.seed, pad_id=tokenizer.pad_token_id or 0)
    reporter = Reporter(out_dir, ctx.rank)
    config = model.base_model.model.config
    trainable, frozen = parameter_counts(model)
    peak = peak_flops(torch.cuda.get_device_name(ctx.device) if ctx.on_gpu else None)
    window_loss = torch.zeros((), device=ctx.device)
    window_tokens = torch.zeros((), device=ctx.device)
    window_real = torch.zeros((), device=ctx.device)
    window_start, window_steps, seq_seen = time.perf_counter(), 0, 0
    summary: dict = {"trainable_params": trainable, "frozen_params": frozen}
    if ctx.rank == 0:
        print(f"training {trainable:,} LoRA parameters over a frozen base of {frozen:,} on {ctx.world} rank(s)",
              flush=True)
    for step in range(recipe.train.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, recipe)
        micro_batches = [{k: v.to(ctx.device, non_blocking=True) for k, v in mb.items()}
                         for mb in batches.micro_batches(step)]
        local_targets = sum((mb["labels"][:, 1:] != IGNORE).sum() for mb in micro_batches)
        global_targets = local_targets.clone().float()
        dist.all_reduce(global_targets)  # the loss is normalised by every target token of the global batch
        for index, mb in enumerate(micro_batches):
            model.set_requires_gradient_sync(index == len(micro_batches) - 1)
            logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
            loss_sum = chunked_loss_sum(logits, mb["labels"])
            (loss_sum * ctx.world / global_targets).backward()  # FSDP averages gradients over ranks
            window_loss += loss_sum.detach()
            window_real += mb["attention_mask"].sum()
            seq_seen = max(seq_seen, mb["input_ids"].size(1))
        window_tokens += local_targets
        grad_norm = torch.nn.utils.clip_grad_norm_(params, recipe.train.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        window_steps += 1
        reporter.heartbeat(step + 1)
        last = step + 1 == recipe.train.steps
        if (step + 1) % recipe.train.log_every == 0 or last:
            record = _reduce_window(ctx, step, window_loss, window_tokens, window_real, window_start, window_steps,
                                    grad_norm, optimizer, seq_seen, config, trainable, frozen, peak,
                                    recipe.model.activation_checkpointing)
            reporter.log(record)
            summary.update(last_loss=record["loss"], first_loss=summary.get("first_loss", record["loss"]))
            window_loss.zero_(), window_tokens.zero_(), window_real.zero_()
            window_start, window_steps = time.perf_counter(), 0
        if recipe.train.save_every and (step + 1) % recipe.train.save_every == 0 and not last:
            checkpoint.save_adapter(model, out_dir, step + 1, recipe.train.keep_last)
    if recipe.train.save_probe_logits:
        _save_probe(model, batches.micro_batches(0)[0], ctx, out_dir)
    saved = checkpoint.save_adapter(model, out_dir, recipe.train.steps, recipe.train.keep_last)
    summary["adapter"] = saved
    if ctx.rank == 0:
        print(f"adapter saved to {out_dir / 'adapter'} ({saved['gathered_bytes'] / 2**20:.2f} MiB gathered in "
              f"{saved['seconds']:.2f}s)", flush=True)
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    reporter.close()
    return summary


@torch.no_grad()
def _save_probe(model, batch: dict, ctx: Context, out_dir: Path) -> None:
    """Every rank runs the forward (FSDP needs them all); rank 0 keeps the logits of its batch."""
    model.eval()
    inputs = {k: v.to(ctx.device) for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits.float().cpu()
    model.train()
    if ctx.rank == 0:
        torch.save({**{k: v.cpu() for k, v in inputs.items()}, "logits": logits}, out_dir / "probe.pt")


def _reduce_window(ctx, step, loss, tokens, real, started, steps, grad_norm, optimizer, seq_len, config,
                   trainable, frozen, peak, recompute) -> dict:
    """The only host synchronisation of the loop: one all-reduce of (loss sum, target tokens, real tokens)."""
    totals = torch.stack([loss, tokens.float(), real.float()])
    dist.all_reduce(totals)
    loss_sum, target_tokens, real_tokens = totals.tolist()
    elapsed = time.perf_counter() - started
    per_gpu = real_tokens / elapsed / ctx.world
    flops = flops_per_token(trainable, frozen, config.num_hidden_layers, config.hidden_size, seq_len, recompute)
    norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    return {
        "step": step + 1, "loss": loss_sum / max(target_tokens, 1.0), "lr": optimizer.param_groups[0]["lr"],
        "grad_norm": float(norm), "tokens_per_s_per_gpu": per_gpu, "step_time_s": elapsed / steps,
        "mfu": per_gpu * flops / peak if peak else None,
        "max_memory_gb": torch.cuda.max_memory_allocated(ctx.device) / 1e9 if ctx.on_gpu else None,
        "time": time.time(),
    }
