"""A tiny random Mixture-of-Experts model with peft LoRA on its fused expert weights (the grouped path's tests)."""
from __future__ import annotations

import sys

import torch

from support import REPO

sys.path.insert(0, str(REPO / "bench" / "common"))


def peft_moe(layout: str, targets: tuple[str, ...], seed: int = 0):
    """A tiny fp32 model of `layout` with peft LoRA on attention and `targets` (fused expert weights), every
    lora_B drawn at random so that each adapter changes the output."""
    import peft
    from transformers import AutoModelForCausalLM

    from make_moe import moe_config

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(layout, 64, 2, 4, 2, 32, 4, 300))
    fused = [t for t in targets if t.endswith("gate_up_proj")]
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=list(targets),
        rank_pattern={t: 8 for t in fused}, alpha_pattern={t: 16 for t in fused}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    return model
