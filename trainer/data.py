"""Data: local JSONL tokenized with the model's own tokenizer; a seeded order that is a pure function of the
step, so every rank takes the same number of steps and a resumed run continues exactly where it stopped."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

IGNORE = -100


class DataError(Exception):
    pass


@dataclass(frozen=True)
class Example:
    input_ids: tuple[int, ...]
    labels: tuple[int, ...]


def encode(record: dict, tokenizer, max_length: int) -> Example:
    """prompt/response: loss on the response and EOS only; text: loss on every token."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if "prompt" in record and "response" in record:
        prompt = bos + tokenizer.encode(record["prompt"], add_special_tokens=False)
        response = tokenizer.encode(record["response"], add_special_tokens=False) + eos
        ids, labels = prompt + response, [IGNORE] * len(prompt) + response
    elif "text" in record:
        ids = bos + tokenizer.encode(record["text"], add_special_tokens=False) + eos
        labels = [IGNORE] * len(bos) + ids[len(bos):]
    else:
        raise DataError("each line needs 'prompt' and 'response', or 'text'")
    return Example(tuple(ids[:max_length]), tuple(labels[:max_length]))


def load_examples(path: str | Path, tokenizer, max_length: int, packing: bool) -> list[Example]:
    examples = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise DataError("expected a JSON object")
                examples.append(encode(record, tokenizer, max_length))
            except (ValueError, DataError) as exc:
                raise DataError(f"{path}:{number}: {exc}") from None
    examples = [e for e in examples if any(label != IGNORE for label in e.labels)]
    if not examples:
        raise DataError(f"{path}: no example with a token to learn from")
    return pack(examples, max_length) if packing else examples


def pack(examples: list[Example], max_length: int) -> list[Example]:
    """Concatenate examples into rows of max_length (documents may attend across a boundary)."""
    ids: list[int] = []
    labels: list[int] = []
    rows = []
    for example in examples:
        ids += example.input_ids
        labels += example.labels
        while len(ids) >= max_length:
            rows.append(Example(tuple(ids[:max_length]), tuple(labels[:max_length])))
            ids, labels = ids[max_length:], labels[max_length:]
    if ids:
        rows.append(Example(tuple(ids), tuple(labels)))
    return rows


class StepBatches:
    """The micro-batches of one rank for any step: a permutation per epoch seeded by (seed, epoch)."""

    def __init__(self, examples: list[Example], *, micro_batch_size: int, grad_accum: int, world_size: int,
                 rank: int, seed: int, pad_id: int) -> None:
        self.examples, self.micro, self.accum = examples, micro_batch_size, grad_accum
        self.world, self.rank, self.seed, self.pad_id = world_size, rank, seed, pad_id
        self._orders: dict[int, list[int]] = {}

    @property
    def global_batch(self) -> int:
        return self.micro * self.accum * self.world

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders = {epoch: torch.randperm(len(self.examples), generator=generator).tolist()}
        return self._orders[epoch]

    def indices(self, step: int, micro_step: int) -> list[int]:
        """Global batch positions laid out as [micro step][rank][row]: any split of the same global batch over
        ranks and accumulation sees the same examples."""
        start = step * self.global_batch + (micro_step * self.world + self.rank) * self.micro
        out = []
        for position in range(start, start + self.micro):
            epoch, offset = divmod(position, len(self.examples))
            out.append(self._order(epoch)[offset])
        return out

    def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        return [collate([self.examples[i] for i in self.indices(step, m)], self.pad_id) for m in range(self.accum)]


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        input_ids[row, :n] = torch.tensor(example.input_ids)
        labels[row, :n] = torch.tensor(example.labels)
        attention[row, :n] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention}
