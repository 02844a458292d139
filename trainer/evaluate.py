"""Held-out evaluation on a deterministic subset (seeded shuffle, then the first N: the same every time, so
curves do not jitter), reduced across ranks in one all-reduce of (loss sum, token count)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .data import IGNORE, Example, collate


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
    """Mean token loss over the subset. Every rank runs the same number of forwards (FSDP needs all of them) on
    batches of the same shape (an expert layout's gathered token exchange needs that): a rank short of rows fills
    its batch with copies of the first whose labels are ignored, and every batch is as wide as the widest row any
    rank has at that step."""
    model.eval()
    shares = [subset[r::world] for r in range(world)]
    steps = -(-max(len(share) for share in shares) // batch_size)
    totals = torch.zeros(2, device=device, dtype=torch.float64)
    for step in range(steps):
        at = slice(step * batch_size, (step + 1) * batch_size)
        filled = [share[at] + subset[:1] * (batch_size - len(share[at])) for share in shares]
        batch = collate(filled[rank], pad_id, max(len(e.input_ids) for rows in filled for e in rows))
        rows = shares[rank][at]
        batch["labels"][len(rows):] = IGNORE
        batch = {k: v.to(device) for k, v in batch.items()}
        positions = batch.get("position_ids")  # packed rows: documents by position, no mask (see data.collate)
        loss_sum = model.loss_sum(batch["input_ids"], None if positions is not None else batch["attention_mask"],
                                  batch["labels"], positions)
        totals[0] += loss_sum.double()
        totals[1] += (batch["labels"][:, 1:] != IGNORE).sum()
    dist.all_reduce(totals)
    if hasattr(model, "reshard"):
        model.reshard()  # the root keeps its parameters unsharded after a forward with no backward
    model.train()
    return (totals[0] / totals[1].clamp(min=1)).item()
