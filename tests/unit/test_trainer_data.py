"""The trainer's data (issue 15, part 1): chat records through the tokenizer's own template with the loss on
assistant turns only, JSONL / Parquet / save_to_disk / globs of shards, the over-long policy, tokenizing once per
node into a cache."""
from __future__ import annotations

import json
import re
import string
import subprocess
import sys
from pathlib import Path

import pytest

from support.trainer_import import trainer_module

data = trainer_module("data")

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen2.5's habit: a default system turn when the conversation has none.
DEFAULT_SYSTEM = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nbe brief<|im_end|>\n{% endif %}"
                  + CHATML)
# Rewrites earlier turns: only the last assistant turn keeps its content (as templates that drop reasoning do).
REWRITING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and not loop.last %}"
             "...{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CONVERSATION = [{"role": "system", "content": "you reverse words"},
                {"role": "user", "content": "reverse: abc"},
                {"role": "assistant", "content": "cba"},
                {"role": "user", "content": "reverse: de"},
                {"role": "assistant", "content": "ed"}]


def char_tokenizer(folder: Path, template: str | None = CHATML):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    chars = string.ascii_lowercase + string.digits + " .:-\n"
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>", *chars])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()   # characters back to text without spaces between them
    fast = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    if template:
        fast.chat_template = template
    fast.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture
def tokenizer(tmp_path):
    return char_tokenizer(tmp_path / "tok")


def learnt(tokenizer, example) -> str:
    return tokenizer.decode([t for t, label in zip(example.input_ids, example.labels) if label != data.IGNORE])


def test_chat_loss_is_on_the_assistant_turns_only(tokenizer):
    example = data.encode({"messages": CONVERSATION}, tokenizer)
    assert tokenizer.decode(example.input_ids).startswith("<|im_start|>system\nyou reverse words<|im_end|>")
    assert learnt(tokenizer, example) == "cba<|im_end|>\ned<|im_end|>\n"   # each turn and its end marker


def test_a_template_that_adds_a_default_system_turn_works(tmp_path):
    tok = char_tokenizer(tmp_path / "qwenish", DEFAULT_SYSTEM)
    example = data.encode({"messages": CONVERSATION[1:]}, tok)
    assert "be brief" in tok.decode(example.input_ids)
    assert learnt(tok, example) == "cba<|im_end|>\ned<|im_end|>\n"


def test_chat_records_that_cannot_be_learnt_are_named(tmp_path, tokenizer):
    with pytest.raises(data.DataError, match="rewrites earlier turns"):
        data.encode({"messages": CONVERSATION}, char_tokenizer(tmp_path / "rewrite", REWRITING))
    with pytest.raises(data.DataError, match="need a tokenizer with a chat template"):
        data.encode({"messages": CONVERSATION}, char_tokenizer(tmp_path / "plain", None))
    with pytest.raises(data.DataError, match="no assistant turn"):
        data.encode({"messages": CONVERSATION[:2]}, tokenizer)
    with pytest.raises(data.DataError, match=r"messages\[1\]: needs a role"):
        data.encode({"messages": [CONVERSATION[0], {"role": "bot", "content": "x"}]}, tokenizer)
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n" + json.dumps({"question": "x"}) + "\n")
    with pytest.raises(data.DataError, match=r"bad.jsonl:2: each record needs 'messages'.*question"):
        data.load_examples(path, tokenizer, 256, False)


RECORDS = [{"messages": CONVERSATION}, {"prompt": "reverse: xyz\n", "response": "zyx."}, {"text": "hello there"}] * 3


def test_jsonl_parquet_save_to_disk_and_a_glob_of_shards_give_the_same_examples(tmp_path, tokenizer, monkeypatch):
    import datasets

    monkeypatch.setenv("NODECTL_DATA_CACHE", str(tmp_path / "cache"))
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    rows = [{"messages": r.get("messages"), "prompt": r.get("prompt"), "response": r.get("response"),
             "text": r.get("text")} for r in RECORDS]
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "train.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "shards").mkdir()
    table.select(range(4)).to_parquet(str(tmp_path / "shards" / "part-0.parquet"))
    table.select(range(4, len(rows))).to_parquet(str(tmp_path / "shards" / "part-1.parquet"))
    # Parquet has one schema for all rows: the columns a record does not use are null
    for record in rows:
        for key in [k for k, v in record.items() if v is None]:
            del record[key]

    want = data.load_examples(jsonl, tokenizer, 256, False)
    assert len(want) == len(RECORDS)
    for source in (tmp_path / "train.parquet", tmp_path / "saved", f"{tmp_path}/shards/*.parquet"):
        assert data.load_examples(source, tokenizer, 256, False) == want, source
    with pytest.raises(data.DataError, match="no file matches"):
        data.load_examples(f"{tmp_path}/none/*.parquet", tokenizer, 256, False)


def test_over_long_examples_are_truncated_or_dropped_and_counted(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("NODECTL_DATA_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": "p: ", "response": "r" * n}) + "\n" for n in (5, 40, 8, 60)))
    said = []
    kept = data.load_examples(path, tokenizer, 20, False, "truncate", log=said.append)
    # <s> + "p: " + the response + </s>
    assert [len(e.input_ids) for e in kept] == [10, 20, 13, 20] and "2 truncated and 0 dropped over 20" in said[0]
    said.clear()
    kept = data.load_examples(path, tokenizer, 20, False, "drop", log=said.append)
    assert [len(e.input_ids) for e in kept] == [10, 13] and "0 truncated and 2 dropped over 20" in said[0]
    with pytest.raises(data.DataError, match="data.overlong: expected one of truncate, drop"):
        data.load_examples(path, tokenizer, 20, False, "cut")


TOKENIZE_ONCE = """
import json, sys
sys.path.insert(0, {tests!r})
from support.trainer_import import trainer_module
from transformers import AutoTokenizer
data = trainer_module("data")
said = []
examples = data.load_examples({path!r}, AutoTokenizer.from_pretrained({tok!r}), 256, True, log=said.append)
print(json.dumps({{"said": said, "rows": len(examples)}}))
"""


@pytest.mark.slow
def test_a_node_tokenizes_once_while_its_other_ranks_wait(tmp_path, tokenizer):
    """Four ranks of one node start together: one tokenizes, three read its cache; a changed file is tokenized
    again."""
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS * 20))
    script = TOKENIZE_ONCE.format(tests=str(Path(__file__).resolve().parents[1]), path=str(path), tok=str(tmp_path / "tok"))
    env = {"NODECTL_DATA_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}

    def ranks(count):
        procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
                 for _ in range(count)]
        return [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]

    answers = ranks(4)
    sources = sorted(re.search(r"\((cache|tokenized),", a["said"][0])[1] for a in answers)
    assert sources == ["cache", "cache", "cache", "tokenized"], answers
    assert len({a["rows"] for a in answers}) == 1 and "packing:" in answers[0]["said"][1]
    path.write_text(path.read_text() + json.dumps({"text": "one more"}) + "\n")
    assert "(tokenized," in ranks(1)[0]["said"][0]


def test_the_demo_model_takes_chat_records(tmp_path):
    """`model.path: demo` with `data.path: my_chat.jsonl` works: the demo tokenizer has a chat template, and the
    loss lands on the assistant's turns."""
    from transformers import AutoTokenizer

    demo = trainer_module("demo")
    demo._write_tokenizer(tmp_path / "demo")
    tok = AutoTokenizer.from_pretrained(tmp_path / "demo")
    example = data.encode({"messages": CONVERSATION}, tok)
    shown = "".join(tok.convert_ids_to_tokens([t for t, label in zip(example.input_ids, example.labels)
                                               if label != data.IGNORE]))
    assert shown == "cba\n</s>ed\n</s>", shown   # each assistant turn and its end marker, nothing else
