"""Trainer pieces without processes: recipe parsing, label masking, the deterministic data order."""
from __future__ import annotations

import pytest

from trainer_import import trainer_module

config = trainer_module("config")
data = trainer_module("data")


class CharTokenizer:
    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def encode(self, text, add_special_tokens=False):
        return [3 + ord(c) % 50 for c in text]


def test_labels_mask_prompt_and_keep_response_and_eos():
    example = data.encode({"prompt": "ab", "response": "cd"}, CharTokenizer(), 64)
    assert example.input_ids[0] == 1 and example.input_ids[-1] == 2
    assert example.labels[:3] == (-100, -100, -100)          # bos + 2 prompt tokens
    assert example.labels[3:] == example.input_ids[3:]       # response and eos are learnt


def test_padding_is_masked_in_collate():
    batch = data.collate([data.Example((1, 5, 6), (-100, 5, 6)), data.Example((1, 7), (-100, 7))], pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 5, 6], [1, 7, 0]]
    assert batch["labels"].tolist() == [[-100, 5, 6], [-100, 7, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]


def test_order_is_deterministic_and_splits_the_same_global_batch():
    examples = [data.Example((1, i + 3), (-100, i + 3)) for i in range(50)]

    def indices(world, accum, rank, step):
        batches = data.StepBatches(examples, micro_batch_size=2, grad_accum=accum, world_size=world, rank=rank,
                                   seed=3, pad_id=0)
        return [i for m in range(accum) for i in batches.indices(step, m)]

    one_rank = indices(1, 2, 0, step=7)
    two_ranks = indices(2, 1, 0, step=7) + indices(2, 1, 1, step=7)
    assert sorted(one_rank) == sorted(two_ranks) and len(set(one_rank)) == 4
    assert indices(2, 1, 1, step=7) == indices(2, 1, 1, step=7)
    assert indices(2, 1, 0, step=7) != indices(2, 1, 0, step=8)


def test_recipe_errors_name_the_key(tmp_path):
    bad = tmp_path / "r.yaml"
    bad.write_text("train:\n  stepz: 3\n")
    with pytest.raises(config.ConfigError, match="train.stepz: unknown key"):
        config.load_recipe(str(bad))
    with pytest.raises(config.ConfigError, match="train.steps: expected int"):
        config.load_recipe(None, ["train.steps=many"])
    with pytest.raises(config.ConfigError, match="model.path: /nope has no config.json"):
        config.load_recipe(None, ["model.path=/nope"])
    recipe = config.load_recipe(None, ["train.steps=3", "lora.target_modules=q_proj,v_proj"])
    assert recipe.train.steps == 3 and recipe.lora.target_modules == ("q_proj", "v_proj")
