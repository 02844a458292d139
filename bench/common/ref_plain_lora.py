"""The reference for the trainer's throughput: the FSDP2 + LoRA script users write today.

transformers model loaded with from_pretrained, peft LoRA, Hugging Face gradient checkpointing with
use_reentrant=False, `fully_shard` per decoder layer and the root, AdamW, eager, the model's own loss
(`labels=`), `loss.item()` every step. Run under torchrun:

    torchrun --nproc-per-node 2 bench/common/ref_plain_lora.py --model DIR --data train.jsonl --seq 4096 --batch 4

For a Mixture-of-Experts model (transformers 5's fused experts), --expert-lora adapts attention and the routed
experts as a user would with peft: target_parameters on the fused expert weights, gate_up_proj at twice the rank
and alpha (the split peft documents, which the trainer uses too), transformers' default grouped_mm experts.
--random-init builds the model from its config.json on the GPU with transformers' own initialisation (a 30B
checkpoint need not exist on disk). On one GPU the model is not wrapped by FSDP (nothing to shard: the fastest
plain setting).

Two things are taken from nodectl's trainer only so that losses can be compared step by step: the order of the
examples (trainer.data.StepBatches) and the seeded initialisation of LoRA A (B starts at zero in both). Writes
one JSON line per step (loss averaged over ranks, step time, tokens) to --out.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--random-init", action="store_true", help="from config.json, transformers' initialisation")
    parser.add_argument("--expert-lora", action="store_true", help="attention + routed experts (target_parameters)")
    parser.add_argument("--out", type=Path, default=Path("ref.jsonl"))
    args = parser.parse_args()

    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.data import StepBatches, load_examples
    from trainer.loop import lr_at

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if args.random_init:
        from transformers import AutoConfig

        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model), dtype=torch.bfloat16)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    if not args.no_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    lora = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    if args.expert_lora:
        fused = sorted({".".join(n.split(".")[-3:]) for n, p in model.named_parameters() if p.dim() == 3})
        gate_up = [n for n in fused if n.endswith("gate_up_proj")]
        lora.update(target_modules=TARGETS[:4], target_parameters=fused, rank_pattern={n: 32 for n in gate_up},
                    alpha_pattern={n: 64 for n in gate_up})
        if rank == 0:
            print(f"expert LoRA on {fused}; experts implementation {model.config._experts_implementation}", flush=True)
    model = get_peft_model(model, LoraConfig(**lora))
    generator = torch.Generator().manual_seed(args.seed)  # as the trainer: A Kaiming-uniform from a seeded stream
    with torch.no_grad():
        for name, param in model.state_dict(keep_vars=True).items():
            if ".lora_A." in name:
                bound = 1 / math.sqrt(param.shape[1])
                param.copy_(torch.empty(param.shape).uniform_(-bound, bound, generator=generator))
    if world > 1:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    else:
        model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = SimpleNamespace(train=SimpleNamespace(warmup_steps=args.warmup, steps=args.steps, lr=args.lr))
    examples = load_examples(args.data, tokenizer, args.seq, packing=False)
    batches = StepBatches(examples, micro_batch_size=args.batch, grad_accum=1, world_size=world, rank=rank,
                          seed=0, pad_id=tokenizer.pad_token_id or 0)
    if rank == 0:
        print(f"reference ready in {time.perf_counter() - started:.1f}s", flush=True)
        out = open(args.out, "w")
    model.train()
    for step in range(args.steps):
        began = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, schedule)
        (batch,) = batches.micro_batches(step)
        batch = {k: v.to(device) for k, v in batch.items()}
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        value = mean.item() / world
        elapsed = time.perf_counter() - began
        if rank == 0:
            tokens = int(batch["attention_mask"].sum()) * world
            record = {"step": step + 1, "loss": value, "step_time_s": elapsed, "real_tokens": tokens,
                      "time": time.time(), "tokens_per_s_per_gpu": tokens / elapsed / world,
                      "max_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9 if on_gpu else None}
            out.write(json.dumps(record) + "\n")
            out.flush()
            print(f"step {step + 1} loss {value:.4f} {record['tokens_per_s_per_gpu']:.0f} tok/s/gpu", flush=True)
    if rank == 0:
        out.close()
    dist.barrier()  # no rank tears down its process group while another still uses it (gloo aborts then)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Out without the interpreter's teardown, as the trainer leaves: under gloo a worker thread of the process group
    # may still be dropping the barrier's work (holding the last all-reduce's tensor) when finalisation starts;
    # its decref then needs the GIL of a dying interpreter and aborts the rank ("terminate called without an
    # active exception", SIGABRT; 2 runs in 32 on 2 loaded cores, core dumps: ProcessGroupGloo::runLoop in
    # ~AsyncBarrierWork). Everything is written and the group destroyed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
