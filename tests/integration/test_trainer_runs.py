"""The built-in trainer under real torchrun processes with gloo on CPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from support import REPO
from support.trainer import demo_folder, metrics, torchrun

pytestmark = pytest.mark.slow


def test_two_ranks_learn_and_the_adapter_reloads_with_peft(tmp_path, demo_cache):
    out = tmp_path / "out"
    proc = torchrun(2, out, demo_cache, "train.steps=40", "train.save_probe_logits=true")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [m["loss"] for m in metrics(out)]
    assert losses[-1] < 0.7 * losses[0]
    adapter = out / "adapter"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()

    summary = json.loads((out / "summary.json").read_text())
    # Only LoRA tensors were gathered: their fp32 bytes, nothing of the frozen base.
    assert summary["adapter"]["gathered_bytes"] == 4 * summary["trainable_params"]
    assert summary["adapter"]["gathered_bytes"] < 4 * summary["frozen_params"]

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(demo_folder(demo_cache) / "model", dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter)).eval()
    probe = torch.load(out / "probe.pt")
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits
    mask = probe["attention_mask"].bool()
    torch.testing.assert_close(logits[mask], probe["logits"][mask], rtol=1e-4, atol=1e-4)
    untrained = AutoModelForCausalLM.from_pretrained(demo_folder(demo_cache) / "model", dtype=torch.float32)
    with torch.no_grad():
        before = untrained(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits
    assert not torch.allclose(before[mask], probe["logits"][mask], atol=1e-2)  # the adapter changed something


def test_accumulation_and_world_size_give_the_same_steps(tmp_path, demo_cache):
    common = ("train.steps=3", "train.log_every=1", "train.micro_batch_size=4", "train.warmup_steps=1")
    one = torchrun(1, tmp_path / "one", demo_cache, *common, "train.grad_accum=2")
    two = torchrun(2, tmp_path / "two", demo_cache, *common, "train.grad_accum=1")
    assert one.returncode == 0 and two.returncode == 0, one.stderr[-2000:] + two.stderr[-2000:]
    for a, b in zip(metrics(tmp_path / "one"), metrics(tmp_path / "two"), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3)


@pytest.mark.parametrize("override,message", [
    ("train.bogus=1", "train.bogus: unknown key"),
    ("model.path=/no/such/model", "model.path: /no/such/model has no config.json"),
    ("lora.target_modules=[nothing_matches]", "lora.target_modules: ['nothing_matches'] matches no module"),
])
def test_bad_recipe_fails_fast_on_every_rank_with_one_message(tmp_path, demo_cache, override, message):
    proc = torchrun(2, tmp_path / "out", demo_cache, override, timeout=120)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert output.count(f"recipe error: {message}") == 1, output[-3000:]
    assert "Traceback" not in output.split("recipe error")[0][-500:]


SLOW_SYNC = '''\
import time
import torch.distributed as dist

_all_reduce = dist.all_reduce


def delayed(tensor, *args, **kwargs):
    if tensor.numel() == 4:  # the trainer's logging window: stands for GPU work still queued at the sync
        time.sleep(0.3)
    return _all_reduce(tensor, *args, **kwargs)


dist.all_reduce = delayed
'''


def test_step_time_is_the_wall_time_between_records_even_with_work_queued_at_the_sync(tmp_path, demo_cache):
    """On a GPU the window's last steps are still running when the host reaches the all-reduce; a clock read
    before that sync missed them. Here the sync itself takes 0.3 s (sitecustomize in every rank)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_SYNC)
    out = tmp_path / "out"
    proc = torchrun(2, out, demo_cache, "train.steps=6", "train.log_every=1", "data.max_length=32",
                    "train.micro_batch_size=2", pythonpath=(str(hook),))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [m for m in metrics(out) if "loss" in m]
    assert len(records) == 6
    for before, after in zip(records, records[1:]):
        gap = after["time"] - before["time"]
        assert after["step_time_s"] > 0.3
        assert abs(after["step_time_s"] - gap) <= 0.02 * gap, (after["step_time_s"], gap)
        by_gap = after["real_tokens"] / gap / 2
        assert abs(after["tokens_per_s_per_gpu"] - by_gap) <= 0.02 * by_gap


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if m['role'] == 'assistant' %}</s>"
                 "{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


def test_chat_records_from_parquet_packed_train_on_two_ranks(tmp_path, demo_cache, monkeypatch):
    """The demo task as conversations in a Parquet file, the demo model's tokenizer given a chat template, rows
    packed: two ranks learn it, and the log says what the data became. The GPU layout (frozen bf16 base, fp32 LoRA
    in their own FSDP units, bf16 compute) exercised on CPU ranks."""
    import shutil

    import datasets

    from support.trainer_import import trainer_module

    monkeypatch.setenv("NODECTL_DEMO_CACHE", str(demo_cache))
    demo = trainer_module("demo")
    model_dir, _ = demo.ensure_demo()
    chat_model = tmp_path / "chat-model"
    shutil.copytree(model_dir, chat_model)
    config = json.loads((chat_model / "tokenizer_config.json").read_text())
    (chat_model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    conversations = [{"messages": [{"role": "user", "content": e["prompt"].strip()},
                                   {"role": "assistant", "content": e["response"]}]}
                     for e in demo.demo_examples(400, seed=3)]
    datasets.Dataset.from_list(conversations).to_parquet(str(tmp_path / "chat.parquet"))
    out = tmp_path / "out"
    proc = torchrun(2, out, demo_cache, f"model.path={chat_model}", f"data.path={tmp_path / 'chat.parquet'}",
                    "data.packing=true", "data.max_length=64", "train.steps=40", "train.micro_batch_size=4",
                    "train.log_every=5", "model.dtype=bfloat16")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "data: 400 examples from 400 record(s)" in proc.stdout
    assert "packing: 400 examples into" in proc.stdout and "of the rows' capacity used" in proc.stdout
    losses = [m["loss"] for m in metrics(out)]
    assert losses[-1] < 0.7 * losses[0], losses


def test_sliced_loading_keeps_rank_0_memory_near_its_shard_not_the_model():
    """bench/trainer/load.py on a small Llama (about 220 MiB in bf16, 2 ranks, a float32 checkpoint): rank 0's owned
    memory (RssAnon, sampled while loading) grows by about its shard when each rank reads its own slices, and by
    more than the whole model when rank 0 reads every weight to broadcast them, as the trainer did before. (From
    a bf16 checkpoint rank 0's full tensors stay pages of the memory-mapped file, which RssAnon does not count.)"""
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "trainer" / "load.py"), "--ranks", "2", "--layers", "4",
                           "--hidden", "1024", "--rounds", "1", "--checkpoint-dtype", "float32"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result["same_weights"]
    model = result["model_mib"]
    assert result["sliced_growth_mib"] < 0.85 * model, result      # its shard (half) and one weight's rows
    assert result["broadcast_growth_mib"] > model, result          # the whole model, then its shard
