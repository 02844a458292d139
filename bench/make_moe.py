"""Write a random-weight Mixture-of-Experts model in one of three layouts (Qwen3-MoE, GLM-4-MoE with shared experts
and a dense first layer, Mixtral), saved by transformers as the Hub has them (one tensor per expert), with the
demo's character tokenizer and the demo task, for the trainer's MoE tests and the GPU proof.

    python bench/make_moe.py OUT --layout qwen3_moe --hidden 1024 --layers 8 --experts 32 --top-k 4
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LAYOUTS = ("qwen3_moe", "glm4_moe", "mixtral")


def moe_config(layout: str, hidden: int, layers: int, experts: int, top_k: int, expert_intermediate: int,
               heads: int, vocab: int):
    from transformers import Glm4MoeConfig, MixtralConfig, Qwen3MoeConfig

    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=max(1, heads // 2), head_dim=hidden // heads, max_position_embeddings=4096,
                  num_experts_per_tok=top_k, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  tie_word_embeddings=False)
    if layout == "qwen3_moe":
        return Qwen3MoeConfig(**common, intermediate_size=4 * expert_intermediate,
                              moe_intermediate_size=expert_intermediate, num_experts=experts, norm_topk_prob=True)
    if layout == "glm4_moe":
        return Glm4MoeConfig(**common, intermediate_size=4 * expert_intermediate,
                             moe_intermediate_size=expert_intermediate, n_routed_experts=experts, n_shared_experts=1,
                             first_k_dense_replace=1, n_group=1, topk_group=1)
    return MixtralConfig(**common, intermediate_size=expert_intermediate, num_local_experts=experts)


def write_moe(out: Path, layout: str, hidden: int = 64, layers: int = 2, experts: int = 4, top_k: int = 2,
              expert_intermediate: int = 32, heads: int = 4, seed: int = 0, weights: bool = True,
              dtype: str = "float32") -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from trainer import demo

    demo_model, demo_data = demo.ensure_demo()
    vocab = json.loads((demo_model / "config.json").read_text())["vocab_size"]
    config = moe_config(layout, hidden, layers, experts, top_k, expert_intermediate, heads, vocab)
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
    shutil.copy(demo_data, out / "train.jsonl")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--layout", choices=LAYOUTS, default="qwen3_moe")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--expert-intermediate", type=int, default=512)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--no-weights", action="store_true", help="config and tokenizer only, for model.init: random")
    args = parser.parse_args()
    write_moe(args.out, args.layout, args.hidden, args.layers, args.experts, args.top_k, args.expert_intermediate,
              args.heads, weights=not args.no_weights, dtype=args.dtype)
    print(args.out)


if __name__ == "__main__":
    main()
