"""Held-out evaluation on a deterministic subset (seeded shuffle, then the first N: the same every time, so
curves do not jitter), reduced across ranks in one all-reduce of (loss sum, token count)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .data import Example, collate


def eval_subset(examples: list[Example], count: int, seed: int) -> list[Example]:
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed + 17)).tolist()
    return [examples[i] for i in order[:count]]


def split(examples: list[Example], holdout: int, seed: int) -> tuple[list[Example], list[Example]]:
    """(train, held out): a seeded choice of `holdout` examples that never reach training."""
    if holdout <= 0:
        return examples, []
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed + 29)).tolist()
    held = set(order[:holdout])
    return [e for i, e in enumerate(examples) if i not in held], [examples[i] for i in sorted(held)]


@torch.no_grad()
def evaluate(model, subset: list[Example], *, rank: int, world: int, batch_size: int, pad_id: int,
             device: torch.device) -> float:
    """Mean token loss over the subset. Every rank runs the same number of forwards (FSDP needs all of them);
    a rank without rows left runs a padded copy whose loss it discards."""
    model.eval()
    mine = subset[rank::world]
    steps = -(-max(len(subset[r::world]) for r in range(world)) // batch_size)
    totals = torch.zeros(2, device=device, dtype=torch.float64)
    for step in range(steps):
        rows = mine[step * batch_size:(step + 1) * batch_size]
        batch = collate(rows or subset[:1], pad_id)
        batch = {k: v.to(device) for k, v in batch.items()}
        positions = batch.get("position_ids")  # packed rows: documents by position, no mask (see data.collate)
        loss_sum = model.loss_sum(batch["input_ids"], None if positions is not None else batch["attention_mask"],
                                  batch["labels"], positions)
        if rows:
            totals[0] += loss_sum.double()
            totals[1] += (batch["labels"][:, 1:] != -100).sum()
    dist.all_reduce(totals)
    if hasattr(model, "reshard"):
        model.reshard()  # the root keeps its parameters unsharded after a forward with no backward
    model.train()
    return (totals[0] / totals[1].clamp(min=1)).item()
