"""Write a random-weight Llama of a given shape to a local folder (no hub), with the demo's character tokenizer
and a synthetic JSONL of long texts, for throughput runs of the built-in trainer.

    python bench/common/make_llama.py OUT --hidden 2048 --layers 16 --heads 32 --kv-heads 8 --intermediate 8192
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import string
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--examples", type=int, default=512)
    parser.add_argument("--chars", type=int, default=4096)
    parser.add_argument("--no-weights", action="store_true",
                        help="config, tokenizer and data only, for model.init: random (a 70B model needs no 140 GB file)")
    args = parser.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM
    from trainer import demo

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=8192, rope_theta=500000.0,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.no_weights:
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        config.save_pretrained(args.out)
    else:
        with torch.device(device):
            model = LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(args.out, safe_serialization=True)
    demo_model, _ = demo.ensure_demo()
    for name in demo_model.iterdir():
        if "token" in name.name or name.name == "special_tokens_map.json":
            shutil.copy(name, args.out / name.name)
    rng = random.Random(0)
    with open(args.out / "train.jsonl", "w") as handle:
        for _ in range(args.examples):
            text = "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(args.chars))
            handle.write(json.dumps({"text": text}) + "\n")
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: {params / 1e9:.2f}B parameters")


if __name__ == "__main__":
    main()
