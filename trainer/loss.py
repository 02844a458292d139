"""Next-token cross-entropy without the full-vocabulary logits of the batch.

A causal LM's own forward returns logits for every position (batch x seq x vocab: 4.2 GB in bf16 for two
sequences of 4096 tokens over Llama 3's 128k vocabulary) and Hugging Face's loss upcasts all of them to fp32.
Here the decoder's hidden states go through the output layer a chunk of rows at a time:

- a frozen, bias-free output layer (the usual LoRA case) takes the fused path: each chunk's logits, log-sum-exp,
  loss and the gradient with respect to the hidden states are computed in the forward and the logits are freed
  at once; backward only scales the stored gradient (the logits are never recomputed);
- any other output layer (LoRA on lm_head, a bias) runs each chunk under non-reentrant checkpointing, so
  backward recomputes one chunk's logits at a time.

Models that change the logits after the output layer (soft-capping, logit scaling) keep the plain path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .data import IGNORE

CHUNK_ROWS = 2048


def logits_loss_sum(logits: torch.Tensor, labels: torch.Tensor, chunk_rows: int = 4096) -> torch.Tensor:
    """Summed next-token cross-entropy of ready logits, upcasting to fp32 one chunk of rows at a time."""
    logits = logits[:, :-1].reshape(-1, logits.size(-1))
    targets = labels[:, 1:].reshape(-1)
    total = logits.new_zeros((), dtype=torch.float32)
    for start in range(0, targets.numel(), chunk_rows):
        total = total + F.cross_entropy(logits[start:start + chunk_rows].float(), targets[start:start + chunk_rows],
                                        ignore_index=IGNORE, reduction="sum")
    return total


class _FrozenHeadCrossEntropy(torch.autograd.Function):
    """sum(CE(hidden @ weight.T, targets)) with d/d(hidden) computed chunk by chunk during the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, want_grad: bool):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad = torch.empty_like(hidden) if want_grad else None
        for start in range(0, targets.numel(), CHUNK_ROWS):
            rows = slice(start, start + CHUNK_ROWS)
            target = targets[rows]
            valid = target != IGNORE
            index = torch.where(valid, target, 0).unsqueeze(1)
            logits = (hidden[rows] @ weight.t()).float()
            lse = torch.logsumexp(logits, dim=-1)
            total += torch.where(valid, lse - logits.gather(1, index).squeeze(1), 0.0).sum()
            if want_grad:
                probs = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place of the logits
                probs.scatter_add_(1, index, torch.full_like(index, -1, dtype=probs.dtype))
                probs.mul_(valid.unsqueeze(1))
                grad[rows] = probs.to(hidden.dtype) @ weight
            del logits
        ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        (grad,) = ctx.saved_tensors
        return grad * grad_total.to(grad.dtype), None, None, None


def _chunk_loss(hidden: torch.Tensor, target: torch.Tensor, head: nn.Module) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), target, ignore_index=IGNORE, reduction="sum")


def head_loss_sum(hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy of decoder hidden states (batch, seq, hidden) through `head`."""
    rows = hidden[:, :-1].reshape(-1, hidden.size(-1))
    targets = labels[:, 1:].reshape(-1)
    want_grad = torch.is_grad_enabled() and rows.requires_grad
    weight = getattr(head, "weight", None)
    if type(head) is nn.Linear and head.bias is None and not weight.requires_grad:
        return _FrozenHeadCrossEntropy.apply(rows, weight, targets, want_grad)
    total = rows.new_zeros((), dtype=torch.float32)
    for start in range(0, targets.numel(), CHUNK_ROWS):
        chunk = (rows[start:start + CHUNK_ROWS], targets[start:start + CHUNK_ROWS], head)
        total = total + (checkpoint(_chunk_loss, *chunk, use_reentrant=False) if want_grad else _chunk_loss(*chunk))
    return total


def _plain_head(config) -> bool:
    """True when the logits are exactly the output layer's: no soft-capping or scaling after it."""
    return (getattr(config, "final_logit_softcapping", None) is None
            and getattr(config, "logit_scale", None) in (None, 1, 1.0)
            and getattr(config, "logits_scaling", None) in (None, 1, 1.0))


def attach(model: nn.Module) -> None:
    """Give the (peft, FSDP-wrapped) model a `loss_sum(input_ids, attention_mask, labels, position_ids=None)` method
    that FSDP treats
    as a forward: the root's parameters (embeddings, final norm, output layer) are gathered around it."""
    causal_lm = model.base_model.model
    decoder = getattr(causal_lm, causal_lm.base_model_prefix, None)
    head = causal_lm.get_output_embeddings()

    if decoder is not None and head is not None and _plain_head(causal_lm.config):
        def loss_sum(input_ids, attention_mask, labels, position_ids=None):
            hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=False).last_hidden_state
            return head_loss_sum(hidden, head, labels)
    else:
        def loss_sum(input_ids, attention_mask, labels, position_ids=None):
            logits = causal_lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False).logits
            return logits_loss_sum(logits, labels)

    model.loss_sum = loss_sum
    try:
        from torch.distributed.fsdp import register_fsdp_forward_method
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import register_fsdp_forward_method
    register_fsdp_forward_method(model, "loss_sum")
