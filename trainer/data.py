"""Data: records from JSONL, Parquet, a `datasets` save_to_disk folder or a glob of shards, tokenized with the
model's own tokenizer (chat records through its chat template), once per node into a cache on the node's disk;
and a seeded order that is a pure function of the step, so every rank takes the same number of steps and a
resumed run continues exactly where it stopped."""
from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

IGNORE = -100
CACHE_VERSION = 1
ROLES = ("system", "user", "assistant", "tool")
OVERLONG = ("truncate", "drop")


class DataError(Exception):
    pass


@dataclass(frozen=True)
class Example:
    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    positions: tuple[int, ...] | None = None   # packed rows: position ids that restart at each document


# ---- records --------------------------------------------------------------------------------------------------

def data_files(path: str | Path) -> list[Path]:
    """The files (or the one save_to_disk folder) a data path names: a file, a folder written by
    `datasets.Dataset.save_to_disk`, or a glob of shards (sorted, so every rank reads them in one order)."""
    text = os.path.expanduser(str(path))
    if any(ch in text for ch in "*?["):
        files = [Path(f) for f in sorted(glob.glob(text, recursive=True)) if Path(f).is_file()]
        if not files:
            raise DataError(f"{path}: no file matches")
        return files
    target = Path(text)
    if target.is_dir():
        if (target / "dataset_info.json").exists() or (target / "state.json").exists() \
                or (target / "dataset_dict.json").exists():
            return [target]
        raise DataError(f"{path}: a folder, but not one written by datasets' save_to_disk; name its files with a "
                        f"glob instead (e.g. {path}/*.parquet)")
    if not target.is_file():
        raise DataError(f"{path}: no such file")
    return [target]


def _jsonl(path: Path) -> Iterator[tuple[str, dict]]:
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise DataError(f"{path}:{number}: not JSON ({exc})") from None
            yield f"{path}:{number}", record


def _hf_dataset(path: Path):
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path}: reading Parquet and datasets folders needs the `datasets` package "
                        f"(pip install 'nodectl[train]')") from None
    if path.is_dir():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise DataError(f"{path}: a DatasetDict without a 'train' split ({', '.join(loaded)})")
            loaded = loaded["train"]
        return loaded
    if path.suffix == ".parquet":
        return datasets.Dataset.from_parquet(str(path), keep_in_memory=False)
    if path.suffix == ".arrow":
        return datasets.Dataset.from_file(str(path))
    raise DataError(f"{path}: unknown format (JSONL .jsonl/.json, Parquet .parquet, Arrow .arrow, or a "
                    f"save_to_disk folder)")


def records(path: str | Path) -> Iterator[tuple[str, dict]]:
    """(where, record) for every record, `where` naming the file and line or row for error messages."""
    for file in data_files(path):
        if file.is_file() and file.suffix in (".jsonl", ".json"):
            yield from _jsonl(file)
        else:
            for number, record in enumerate(_hf_dataset(file)):
                # one schema for all rows: the columns a record does not use are null
                yield f"{file} row {number}", {k: v for k, v in record.items() if v is not None}


# ---- tokenizing -------------------------------------------------------------------------------------------------

def encode(record: dict, tokenizer, max_length: int | None = None) -> Example:
    """messages: the tokenizer's chat template, loss on the assistant turns only; prompt/response: loss on the
    response and EOS only; text: loss on every token. Not cut here (see the over-long policy in load_examples),
    unless max_length is given."""
    if not isinstance(record, dict):
        raise DataError("expected a JSON object")
    if "messages" in record:
        ids, labels = encode_chat(record["messages"], tokenizer)
    else:
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
            raise DataError(f"each record needs 'messages', 'prompt' and 'response', or 'text' (this one has "
                            f"{', '.join(sorted(map(str, record))) or 'no keys'})")
    if max_length is not None:
        ids, labels = ids[:max_length], labels[:max_length]
    return Example(tuple(ids), tuple(labels))


def _render(tokenizer, messages, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise DataError("'messages' must be a non-empty list of {role, content}")
    for position, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise DataError(f"messages[{position}]: needs a role of {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str) and not message.get("tool_calls"):
            raise DataError(f"messages[{position}] ({message['role']}): content must be text")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError("no assistant turn to learn from")


def assistant_spans(tokenizer, messages) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns. Each span runs from the end of
    the conversation before that turn rendered with the generation prompt (the assistant header) to the end of
    the conversation up to and including the turn (its content and end-of-turn marker). This works for templates
    without `{% generation %}` tags, as long as the template renders a conversation's prefix as a prefix of the
    whole; a template that rewrites earlier turns (one that drops earlier reasoning) is refused by name."""
    full = _render(tokenizer, messages, False)
    spans = []
    for position, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:position], True) if position else ""
        upto = _render(tokenizer, messages[:position + 1], False)
        if not (full.startswith(upto) and upto.startswith(before)):
            raise DataError(f"the chat template does not render messages[:{position + 1}] as a prefix of the "
                            f"whole conversation (it rewrites earlier turns), so the assistant turns cannot be "
                            f"found; use a template that keeps earlier turns as they are, or split the conversation")
        spans.append((len(before), len(upto)))
    return full, spans


def encode_chat(messages, tokenizer) -> tuple[list[int], list[int]]:
    _check_messages(messages)
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("records with 'messages' need a tokenizer with a chat template (chat_template in the "
                        "model folder's tokenizer_config.json or chat_template.jinja)")
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("records with 'messages' need a fast tokenizer (tokenizer.json) to map turns to tokens")
    text, spans = assistant_spans(tokenizer, messages)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, labels = list(encoded["input_ids"]), []
    for token, (start, end) in zip(ids, encoded["offset_mapping"]):
        inside = any(a <= start < b for a, b in spans) if end > start else False
        labels.append(token if inside else IGNORE)
    return ids, labels


# ---- loading, once per node --------------------------------------------------------------------------------------

def _tokenizer_fingerprint(tokenizer) -> str:
    folder = Path(getattr(tokenizer, "name_or_path", "") or "")
    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "tokenizer.model", "vocab.json", "merges.txt"):
        path = folder / name
        if path.is_file():
            digest.update(name.encode() + path.read_bytes())
    digest.update(str(getattr(tokenizer, "chat_template", "")).encode())
    return digest.hexdigest()


def cache_key(path, tokenizer, max_length: int, overlong: str) -> str:
    files = data_files(path)
    facts = []
    for file in files:
        for part in ([file] if file.is_file() else sorted(p for p in file.rglob("*") if p.is_file())):
            stat = part.stat()
            facts.append([str(part.resolve()), stat.st_size, stat.st_mtime_ns])
    key = json.dumps([CACHE_VERSION, facts, _tokenizer_fingerprint(tokenizer), max_length, overlong])
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def cache_dir() -> Path:
    base = os.environ.get("NODECTL_DATA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "nodectl", "tokenized")
    return Path(base)


def tokenize_all(path, tokenizer, max_length: int, overlong: str) -> tuple[list[Example], dict]:
    examples, stats = [], {"records": 0, "truncated": 0, "dropped": 0, "no_target": 0}
    for where, record in records(path):
        stats["records"] += 1
        try:
            example = encode(record, tokenizer)
        except DataError as exc:
            raise DataError(f"{where}: {exc}") from None
        if len(example.input_ids) > max_length:
            if overlong == "drop":
                stats["dropped"] += 1
                continue
            stats["truncated"] += 1
            example = Example(example.input_ids[:max_length], example.labels[:max_length])
        if not any(label != IGNORE for label in example.labels[1:]):
            stats["no_target"] += 1
            continue
        examples.append(example)
    return examples, stats


def _save(examples: list[Example], stats: dict, target: Path) -> None:
    lengths = torch.tensor([len(e.input_ids) for e in examples], dtype=torch.int64)
    flat_ids = torch.tensor([t for e in examples for t in e.input_ids], dtype=torch.int64)
    flat_labels = torch.tensor([t for e in examples for t in e.labels], dtype=torch.int64)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    torch.save({"lengths": lengths, "ids": flat_ids, "labels": flat_labels, "stats": stats}, tmp)
    os.replace(tmp, target)


def _load(target: Path) -> tuple[list[Example], dict]:
    saved = torch.load(target, weights_only=True)
    examples, at = [], 0
    ids, labels = saved["ids"].tolist(), saved["labels"].tolist()
    for n in saved["lengths"].tolist():
        examples.append(Example(tuple(ids[at:at + n]), tuple(labels[at:at + n])))
        at += n
    return examples, saved["stats"]


def load_examples(path: str | Path, tokenizer, max_length: int, packing: bool, overlong: str = "truncate",
                  log=None) -> list[Example]:
    """Every example of `path`, tokenized once per node: the first rank of the node to take the lock tokenizes and
    writes the cache (keyed by the data files, the tokenizer and these settings); the others wait and read it."""
    if overlong not in OVERLONG:
        raise DataError(f"data.overlong: expected one of {', '.join(OVERLONG)}, got {overlong!r}")
    key = cache_key(path, tokenizer, max_length, overlong)
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{key}.pt"
    started = time.perf_counter()
    with open(folder / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            examples, stats = _load(target)
            source = "cache"
        else:
            examples, stats = tokenize_all(path, tokenizer, max_length, overlong)
            _save(examples, stats, target)
            source = "tokenized"
    if not examples:
        raise DataError(f"{path}: no example with a token to learn from ({stats['records']} record(s))")
    if log:
        log(f"data: {len(examples)} examples from {stats['records']} record(s) ({source}, "
            f"{time.perf_counter() - started:.1f}s; {stats['truncated']} truncated and {stats['dropped']} dropped "
            f"over {max_length} tokens, {stats['no_target']} without a target)")
    if not packing:
        return examples
    rows = pack(examples, max_length)
    if log:
        log(f"packing: {len(examples)} examples into {len(rows)} rows of up to {max_length} tokens, "
            f"{packing_efficiency(rows, max_length):.1%} of the rows' capacity used")
    return rows


def pack(examples: list[Example], max_length: int) -> list[Example]:
    """Whole documents into rows of at most max_length tokens, in order (a document never spans two rows). Position
    ids restart at 0 for each document: transformers turns that into a per-document causal mask (SDPA, eager and
    flex attention build it from the position ids; flash attention runs its variable-length kernel on them), so no
    token attends across a boundary. Each document's first label is ignored: it would be predicted from the end of
    the previous document."""
    rows, ids, labels, positions = [], [], [], []
    for example in examples:
        if ids and len(ids) + len(example.input_ids) > max_length:
            rows.append(Example(tuple(ids), tuple(labels), tuple(positions)))
            ids, labels, positions = [], [], []
        ids += example.input_ids
        labels += (IGNORE,) + example.labels[1:]
        positions += range(len(example.input_ids))
    if ids:
        rows.append(Example(tuple(ids), tuple(labels), tuple(positions)))
    return rows


def packing_efficiency(rows: list[Example], max_length: int) -> float:
    """Real tokens over the row capacity (rows x max_length)."""
    return sum(len(r.input_ids) for r in rows) / max(1, len(rows) * max_length)


class StepBatches:
    """The micro-batches of one rank for any step: a permutation per epoch seeded by (seed, epoch)."""

    def __init__(self, examples: list[Example], *, micro_batch_size: int, grad_accum: int, world_size: int,
                 rank: int, seed: int, pad_id: int) -> None:
        self.examples, self.micro, self.accum = examples, micro_batch_size, grad_accum
        self.world, self.rank, self.seed, self.pad_id = world_size, rank, seed, pad_id
        self._orders: dict[int, list[int]] = {}
        self.waited = 0.0   # seconds this rank spent getting its batches ready (the heartbeat's data_s)

    @property
    def global_batch(self) -> int:
        return self.micro * self.accum * self.world

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders = {epoch: torch.randperm(len(self.examples), generator=generator).tolist()}
        return self._orders[epoch]

    def indices(self, step: int, micro_step: int, rank: int | None = None) -> list[int]:
        """Global batch positions laid out as [micro step][rank][row]: any split of the same global batch over
        ranks and accumulation sees the same examples. `rank`: another rank's (default: this one's)."""
        rank = self.rank if rank is None else rank
        start = step * self.global_batch + (micro_step * self.world + rank) * self.micro
        out = []
        for position in range(start, start + self.micro):
            epoch, offset = divmod(position, len(self.examples))
            out.append(self._order(epoch)[offset])
        return out

    def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches, each padded to the widest row any rank has in that micro step (read from the
        shared example list, no communication): every rank's micro-batch has the same shape, as an expert layout's
        gathered token exchange needs, and a step already waits for its widest rank."""
        out = []
        for m in range(self.accum):
            width = max(len(self.examples[i].input_ids) for r in range(self.world) for i in self.indices(step, m, r))
            out.append(collate([self.examples[i] for i in self.indices(step, m)], self.pad_id, width))
        return out


def collate(examples: list[Example], pad_id: int, width: int = 0) -> dict[str, torch.Tensor]:
    """Padded tensors, at least `width` wide. Packed rows also get position_ids; their padding is one more
    "document" (positions from 0, labels ignored), so the model needs no attention mask and reads the documents
    from the positions alone."""
    width = max(width, *(len(e.input_ids) for e in examples))
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    packed = any(e.positions is not None for e in examples)
    positions = torch.zeros((len(examples), width), dtype=torch.long) if packed else None
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        input_ids[row, :n] = torch.tensor(example.input_ids)
        labels[row, :n] = torch.tensor(example.labels)
        attention[row, :n] = 1
        if packed:
            own = example.positions if example.positions is not None else range(n)
            positions[row, :n] = torch.tensor(list(own))
            positions[row, n:] = torch.arange(width - n)
    batch = {"input_ids": input_ids, "labels": labels, "attention_mask": attention}
    if packed:
        batch["position_ids"] = positions
    return batch
