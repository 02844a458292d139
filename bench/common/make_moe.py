"""Write a random-weight Mixture-of-Experts model in one of three layouts (Qwen3-MoE, GLM-4-MoE with shared experts
and a dense first layer, Mixtral), saved by transformers as the Hub has them (one tensor per expert), with the
demo's character tokenizer and the demo task, for the trainer's MoE tests and the GPU proof.

    python bench/common/make_moe.py OUT --layout qwen3_moe --hidden 1024 --layers 8 --experts 32 --top-k 4
    python bench/common/make_moe.py OUT --shape qwen3-30b-a3b --no-weights --examples 400 --chars 4100

--shape names a published model's dimensions (random weights, the demo tokenizer, so token ids stay small while
the embedding and output layer keep the real vocabulary); --examples/--chars replace the demo task with that
many random texts of that many characters (one token per character: rows of a chosen length).
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import string
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

LAYOUTS = ("qwen3_moe", "glm4_moe", "mixtral")
# Published dimensions (config.json of each model on the Hub): layout and write_moe's keyword arguments.
SHAPES = {
    "qwen3-30b-a3b": ("qwen3_moe", dict(hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, experts=128,
                                        top_k=8, expert_intermediate=768, vocab=151936)),
    "glm-4.5-air": ("glm4_moe", dict(hidden=4096, layers=46, heads=96, kv_heads=8, head_dim=128, experts=128,
                                     top_k=8, expert_intermediate=1408, intermediate=10944, vocab=151552)),
}


def moe_config(layout: str, hidden: int, layers: int, experts: int, top_k: int, expert_intermediate: int,
               heads: int, vocab: int, kv_heads: int = 0, head_dim: int = 0, intermediate: int = 0):
    from transformers import Glm4MoeConfig, MixtralConfig, Qwen3MoeConfig

    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads or max(1, heads // 2), head_dim=head_dim or hidden // heads,
                  max_position_embeddings=8192, num_experts_per_tok=top_k, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, tie_word_embeddings=False)
    if layout == "qwen3_moe":
        return Qwen3MoeConfig(**common, intermediate_size=intermediate or 4 * expert_intermediate,
                              moe_intermediate_size=expert_intermediate, num_experts=experts, norm_topk_prob=True)
    if layout == "glm4_moe":
        return Glm4MoeConfig(**common, intermediate_size=intermediate or 4 * expert_intermediate,
                             moe_intermediate_size=expert_intermediate, n_routed_experts=experts, n_shared_experts=1,
                             first_k_dense_replace=1, n_group=1, topk_group=1)
    return MixtralConfig(**common, intermediate_size=expert_intermediate, num_local_experts=experts)


def write_moe(out: Path, layout: str, hidden: int = 64, layers: int = 2, experts: int = 4, top_k: int = 2,
              expert_intermediate: int = 32, heads: int = 4, seed: int = 0, weights: bool = True,
              dtype: str = "float32", vocab: int = 0, kv_heads: int = 0, head_dim: int = 0, intermediate: int = 0,
              examples: int = 0, chars: int = 0) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from trainer import demo

    demo_model, demo_data = demo.ensure_demo()
    vocab = vocab or json.loads((demo_model / "config.json").read_text())["vocab_size"]
    config = moe_config(layout, hidden, layers, experts, top_k, expert_intermediate, heads, vocab, kv_heads,
                        head_dim, intermediate)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    if weights:
        model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
        model.save_pretrained(out)
    else:
        config.save_pretrained(out)
    for name in demo_model.iterdir():
        if "token" in name.name or name.name == "special_tokens_map.json":
            shutil.copy(name, out / name.name)
    if examples:
        rng = random.Random(seed)
        with open(out / "train.jsonl", "w") as handle:
            for _ in range(examples):
                handle.write(json.dumps({"text": "".join(rng.choices(string.ascii_lowercase + " ", k=chars))}) + "\n")
    else:
        shutil.copy(demo_data, out / "train.jsonl")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a published model's dimensions (overrides the rest)")
    parser.add_argument("--shape-layers", type=int, default=0, help="with --shape: only this many of its layers")
    parser.add_argument("--layout", choices=LAYOUTS, default="qwen3_moe")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--expert-intermediate", type=int, default=512)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--examples", type=int, default=0, help="random texts instead of the demo task")
    parser.add_argument("--chars", type=int, default=4096)
    parser.add_argument("--no-weights", action="store_true", help="config and tokenizer only, for model.init: random")
    args = parser.parse_args()
    layout, shape = SHAPES[args.shape] if args.shape else (args.layout, dict(
        hidden=args.hidden, layers=args.layers, experts=args.experts, top_k=args.top_k,
        expert_intermediate=args.expert_intermediate, heads=args.heads))
    if args.shape and args.shape_layers:
        shape = {**shape, "layers": args.shape_layers}
    write_moe(args.out, layout, **shape, weights=not args.no_weights, dtype=args.dtype, examples=args.examples,
              chars=args.chars)
    print(args.out)


if __name__ == "__main__":
    main()
