"""The trainer's parts keep their own schedule (trainer/loop.py: Profiler, AdapterSaves, Evaluator, Checkpointer,
Logger): the loop asks each whether a step is its own. Each rule here as the recipe's key says it."""
from __future__ import annotations

import signal
import time
from dataclasses import replace

import torch

from support.trainer_import import trainer_module

loop = trainer_module("loop")
config = trainer_module("config")
CPU = loop.Context(rank=0, world=1, local_rank=0, device=torch.device("cpu"), on_gpu=False)


def recipe(**train):
    return replace(config.Recipe(), train=replace(config.TrainConfig(), **train))


def test_the_profiler_covers_its_step_and_the_next_and_rank_0_writes_the_table(tmp_path):
    profiler = loop.Profiler(3, CPU, tmp_path)
    running = []
    for done in range(1, 7):
        profiler.before(done)
        torch.ones(64, 64) @ torch.ones(64, 64)
        running.append(profiler.running is not None)
        profiler.after(done, last=done == 6)
    assert running == [False, False, True, True, False, False]
    assert "aten::mm" in (tmp_path / "profile.txt").read_text()
    cut_short = loop.Profiler(3, CPU, tmp_path / "short")
    (tmp_path / "short").mkdir()
    cut_short.before(3)
    cut_short.after(3, last=True)   # the run's last step ends the profile too
    assert cut_short.running is None and (tmp_path / "short" / "profile.txt").is_file()


def test_adapter_saves_come_every_save_every_steps_but_not_on_the_last(monkeypatch, tmp_path):
    saved = []
    monkeypatch.setattr(loop.checkpoint, "save_adapter", lambda model, out, step, keep: saved.append((step, keep)))
    adapters = loop.AdapterSaves(recipe(save_every=4, keep_last=3), object(), tmp_path)
    for done in range(1, 13):
        adapters.after(done, last=done == 12)
    assert saved == [(4, 3), (8, 3)]   # step 12's is the loop's own, after it
    assert not loop.AdapterSaves(recipe(save_every=0), object(), tmp_path).due(4)


def test_evaluation_and_checkpoints_are_due_by_their_own_keys(tmp_path):
    default_term = signal.getsignal(signal.SIGTERM)   # the Checkpointer's TermRequest takes SIGTERM: given back
    try:
        _due_by_their_own_keys(tmp_path)
    finally:
        signal.signal(signal.SIGTERM, default_term)


def _due_by_their_own_keys(tmp_path):
    evaluator = loop.Evaluator(recipe(eval_every=5), CPU, None, [], None, None, {})
    assert [d for d in range(1, 16) if evaluator.due(d)] == [5, 10, 15] and evaluator.best is None
    assert not any(loop.Evaluator(recipe(), CPU, None, [], None, None, {}).due(d) for d in range(1, 16))
    checkpointer = loop.Checkpointer(recipe(checkpoint_every=4, checkpoint_minutes=0.0005), CPU, None, None, None,
                                     tmp_path, 0, None)
    assert [d for d in range(1, 13) if checkpointer.every(d)] == [4, 8, 12]
    time.sleep(0.05)   # past 0.0005 minutes: due, but asked only at a logging step (one collective per window)
    assert checkpointer.asked(False) == (False, False) and checkpointer.asked(True) == (True, False)
    checkpointer.term.asked = True   # SIGTERM noted
    assert checkpointer.asked(True)[1] is True
