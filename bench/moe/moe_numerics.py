"""One routed-experts layer in bf16, peft's ParamWrapper path and the trainer's grouped path, each against the same
layer in fp32 (issue 25's loss comparison). On any device:

    python3 bench/moe/moe_numerics.py --hidden 2048 --expert-intermediate 768 --experts 128 --top-k 8 --tokens 8192

For B = 0 (step 1) and for each --b-scale (B = ±scale: about one Adam step at that learning rate), prints the
share of the fp32 LoRA contribution to the output that each path keeps (projection on the exact contribution), and
the relative error and sign disagreement of every adapter gradient against fp32.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--expert-intermediate", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--b-scale", default="4e-5,4e-4")
    args = parser.parse_args()

    import peft
    from peft.tuners.lora.layer import ParamWrapper
    from transformers import AutoModelForCausalLM

    from make_moe import moe_config
    from trainer import moe

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    config = moe_config("qwen3_moe", args.hidden, 1, args.experts, args.top_k, args.expert_intermediate, 16, 300)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.02)
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=16, lora_alpha=32, target_modules=["q_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        rank_pattern={"mlp.experts.gate_up_proj": 32}, alpha_pattern={"mlp.experts.gate_up_proj": 64})).to(device)
    experts = model.base_model.model.model.layers[0].mlp.experts
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(args.tokens, args.hidden, generator=gen, device=device)
    logits = torch.randn(args.tokens, args.experts, generator=gen, device=device)
    weights, index = torch.topk(torch.softmax(logits, -1), args.top_k)
    weights = weights / weights.sum(-1, keepdim=True)
    upstream = torch.randn(args.tokens, args.hidden, generator=gen, device=device)
    grouped_type = moe.grouped_wrapper_type()

    def run(dtype, grouped: bool, adapters: bool = True):
        model.to(dtype)
        model.zero_grad()
        experts.__class__ = grouped_type if grouped else ParamWrapper
        if adapters:
            y = experts(x.to(dtype), index, weights.to(dtype))
            (y.float() * upstream).sum().backward()
            grads = {n.split("experts")[-1].removeprefix(".").replace(".default.weight", ""): p.grad.float().clone()
                     for n, p in experts.named_parameters() if p.requires_grad}
            return y.detach().float(), grads
        with torch.no_grad(), model.disable_adapter():
            return experts(x.to(dtype), index, weights.to(dtype)).float(), {}

    print(f"device {device}, torch {torch.__version__}, peft {peft.__version__}; {args.experts} experts, top-{args.top_k}, "
          f"hidden {args.hidden}, expert FFN {args.expert_intermediate}, {args.tokens} tokens")
    for scale in [0.0] + [float(s) for s in args.b_scale.split(",")]:
        with torch.no_grad():
            for name, param in experts.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.sign(torch.randn_like(param)) * scale)
        base, _ = run(torch.float32, False, adapters=False)
        exact, exact_grads = run(torch.float32, False)
        contribution = exact - base
        print(f"B = ±{scale:g}")
        for grouped in (False, True):
            out, grads = run(torch.bfloat16, grouped)
            kept = ((out - base) * contribution).sum() / (contribution * contribution).sum() if scale else None
            errors = ", ".join(f"{k} {((g - exact_grads[k]).norm() / exact_grads[k].norm()).item():.4f} "
                               f"({(torch.sign(g) != torch.sign(exact_grads[k])).float().mean().item():.4f} signs)"
                               for k, g in grads.items() if exact_grads[k].norm() > 0)
            print(f"   {'grouped' if grouped else 'peft   '}  contribution kept "
                  f"{'-' if kept is None else f'{kept.item():.3f}'}  gradient error vs fp32: {errors}")


if __name__ == "__main__":
    main()
