"""The built-in demo: a small random-initialised Llama with a character tokenizer, and a task where learning
shows within a couple of minutes on a CPU. Created once, deterministically, and cached."""
from __future__ import annotations

import json
import os
import random
import string
import time
from pathlib import Path

DEMO_VERSION = 2   # 2: the tokenizer has a chat template
# Chat with `model.path: demo`: "role: text" lines, an assistant turn ending with the end-of-sequence token, in the
# demo's own characters (lower-case letters, digits, " .:-" and newlines; any other character reads as <unk>).
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                 "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
CHARS = string.ascii_lowercase + string.digits + " .:-\n"


def demo_root() -> Path:
    base = os.environ.get("NODECTL_DEMO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "nodectl")
    return Path(base) / f"demo-v{DEMO_VERSION}"


def demo_examples(count: int, seed: int) -> list[dict]:
    """'reverse: abcd' -> 'answer: dcba.' The fixed words are learnt first; the reversal takes longer."""
    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        word = "".join(rng.choice(string.ascii_lowercase[:8]) for _ in range(rng.randint(3, 6)))
        examples.append({"prompt": f"reverse: {word}\n", "response": f"answer: {word[::-1]}."})
    return examples


def _write_tokenizer(folder: Path) -> None:
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {token: i for i, token in enumerate(specials + list(CHARS))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


def _write_model(folder: Path, vocab_size: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder, safe_serialization=True)


def ensure_demo() -> tuple[Path, Path]:
    """(model folder, data file). Builds them on first use; concurrent ranks wait for the first builder."""
    root = demo_root()
    model_dir, data_file, done = root / "model", root / "train.jsonl", root / ".complete"
    if done.exists():
        return model_dir, data_file
    root.mkdir(parents=True, exist_ok=True)
    lock = root / ".lock"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        deadline = time.time() + 300
        while not done.exists():
            if time.time() > deadline:
                raise RuntimeError(f"waited 5 minutes for {root} to be built; remove {lock} if no build runs")
            time.sleep(0.2)
        return model_dir, data_file
    try:
        _write_tokenizer(model_dir)
        _write_model(model_dir, vocab_size=4 + len(CHARS))
        with open(data_file, "w", encoding="utf-8") as handle:
            for example in demo_examples(4000, seed=7):
                handle.write(json.dumps(example) + "\n")
        done.write_text(str(time.time()))
    finally:
        os.close(fd)
        lock.unlink(missing_ok=True)
    return model_dir, data_file
