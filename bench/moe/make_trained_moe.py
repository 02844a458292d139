"""A small Mixture-of-Experts of Qwen3's layout, pretrained here on real text, so that FP8 experts can be judged on
weights that were trained (issue 71: no pretrained MoE can be fetched; random weights were all that was compared).

    python3 bench/moe/make_trained_moe.py OUT [--minutes 8] [--hidden 768 --layers 8 --experts 32 --top-k 4
        --expert-intermediate 384 --vocab 8192 --seq 512 --batch 32]
    python3 bench/moe/gpu_moe_speed.py --work /tmp/w --model OUT --no-ref --steps 200 --skip 5 \\
        --run bf16:model.init=checkpoint,lora.r=16 --run fp8:model.init=checkpoint,lora.r=16,model.fp8_experts=true \\
        --compare bf16,fp8

The text is the machine's own Python standard library: its modules' source and `pydoc_data`'s documentation
topics. A byte-level BPE tokenizer (`tokenizers`) is trained on it first; 2% of the files are held out. The model
(about 260 M parameters at the defaults, 60 M active) is pretrained from random weights with AdamW in bf16 for
--minutes on one GPU (or --steps), its training loss printed against the uniform guess (ln of the vocabulary: 9.01
at 8,192) and the held-out loss at the end, then saved with `save_pretrained` (safetensors) beside its tokenizer.
`train.jsonl` (rows of --seq tokens' worth of the held-out files, `{"text": ...}`) is what the LoRA fine-tune reads.
`--tiny` makes a 2-layer model for a few seconds on a CPU: the script's own check, nothing to judge FP8 on.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import sysconfig
import time
from pathlib import Path


def corpus(seed: int) -> tuple[list[str], list[str]]:
    """(training texts, held-out texts): every .py file of the standard library and the documentation topics."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or "tests" in path.parts:
            continue
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
    try:
        from pydoc_data.topics import topics

        texts += list(topics.values())
    except ImportError:
        pass
    random.Random(seed).shuffle(texts)
    held = max(1, len(texts) // 50)
    return texts[held:], texts[:held]


def tokenizer_for(texts: list[str], vocab: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    return fast


def stream(ids: list[int], seq: int, batch: int, rng: random.Random):
    while True:
        starts = [rng.randrange(0, len(ids) - seq - 1) for _ in range(batch)]
        yield [ids[s:s + seq + 1] for s in starts]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--expert-intermediate", type=int, default=384)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--minutes", type=float, default=8.0)
    parser.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: by --minutes)")
    parser.add_argument("--rows", type=int, default=400, help="rows of train.jsonl for the fine-tune")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    if args.tiny:
        args.hidden, args.layers, args.experts, args.top_k, args.expert_intermediate, args.heads = 64, 2, 4, 2, 32, 4
        args.vocab, args.seq, args.batch, args.rows = 512, 64, 4, 20
        args.steps = args.steps or 20

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "common"))
    from make_moe import moe_config
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train_texts, held_texts = corpus(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    tokenizer = tokenizer_for(train_texts, args.vocab, args.out)
    vocab = len(tokenizer)
    ids = [t for text in train_texts for t in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
    held = [t for text in held_texts for t in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
    print(f"corpus: {len(train_texts)} texts, {len(ids):,} tokens ({len(held):,} held out); tokenizer of {vocab} "
          f"in {time.perf_counter() - began:.0f}s", flush=True)

    config = moe_config("qwen3_moe", args.hidden, args.layers, args.experts, args.top_k, args.expert_intermediate,
                        args.heads, vocab, kv_heads=max(1, args.heads // 4), head_dim=args.hidden // args.heads)
    config.pad_token_id, config.bos_token_id, config.eos_token_id = (tokenizer.pad_token_id, tokenizer.bos_token_id,
                                                                     tokenizer.eos_token_id)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config).to(device)
    total = sum(p.numel() for p in model.parameters())
    print(f"model: {total / 1e6:.0f} M parameters, {args.layers} layers, {args.experts} experts (top {args.top_k}); "
          f"the uniform guess's loss: {math.log(vocab):.2f}", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    batches = stream(ids, args.seq, args.batch, random.Random(args.seed))
    limit = began + 60 * args.minutes
    step, started, loss = 0, time.perf_counter(), None
    model.train()
    while (args.steps and step < args.steps) or (not args.steps and time.perf_counter() < limit):
        rows = torch.tensor(next(batches), device=device)
        warm = min(1.0, (step + 1) / 100)
        for group in optimizer.param_groups:
            group["lr"] = args.lr * warm
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=rows[:, :-1], labels=rows[:, :-1].clone()).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % 50 == 0 or step == 1:
            print(f"step {step:>6}  loss {loss.item():.3f}  {time.perf_counter() - started:.0f}s", flush=True)

    model.eval()
    losses = []
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        for start in range(0, min(len(held) - args.seq - 1, 64 * args.seq), args.seq):
            rows = torch.tensor([held[start:start + args.seq]], device=device)
            losses.append(model(input_ids=rows, labels=rows).loss.item())
    held_loss = sum(losses) / max(1, len(losses))
    model.to(torch.bfloat16).save_pretrained(args.out)
    text = tokenizer.decode(held)
    width = args.seq * 3   # characters: about a row of --seq tokens, cut by the trainer's max_length
    with open(args.out / "train.jsonl", "w") as handle:
        for i in range(args.rows):
            piece = text[(i * width) % max(1, len(text) - width):][:width]
            handle.write(json.dumps({"text": piece}) + "\n")
    print(json.dumps({"steps": step, "train_loss": round(loss.item(), 3) if loss is not None else None,
                      "held_out_loss": round(held_loss, 3), "uniform_loss": round(math.log(vocab), 2),
                      "parameters": total, "seconds": round(time.perf_counter() - began, 1), "out": str(args.out)}),
          flush=True)


if __name__ == "__main__":
    main()
