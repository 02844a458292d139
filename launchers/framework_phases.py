"""The goodput ledger's phases from trainers nodectl did not write, seen without changing the script.

sitecustomize.py (in every rank) installs `install()`'s import hook: when the program imports Hugging Face's
`transformers.trainer` or Lightning's trainer module (`lightning.pytorch` or `pytorch_lightning`), its Trainer
class is wrapped in place, once:
- its checkpoint save (HF `Trainer._save_checkpoint`, Lightning `Trainer.save_checkpoint`) and its evaluation
  (HF `Trainer.evaluate`, Lightning's validation between `on_validation_start` and `on_validation_end`) are timed
  and marked with nodectl_metrics.phase ("checkpoint", "eval");
- each optimizer step reports its global step (nodectl_metrics.report), and on HF the loss it logged, which marks
  the run's first step and keeps the heartbeat fresh.
Data waits are not seen (neither trainer says when it waits for a batch); the ledger names them unseen. A script
that calls nodectl_metrics itself keeps its own reports: the steps are then not reported twice. Anything that fails
here leaves the program as it was. Standard library only at import.
"""
from __future__ import annotations

import importlib.abc
import sys
import time

HF = "transformers.trainer"
LIGHTNING = ("lightning.pytorch.trainer.trainer", "pytorch_lightning.trainer.trainer")
_WRAPPED = "_nodectl_phases"


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    for name in (HF, *LIGHTNING):   # imported before this ran (another sitecustomize): wrapped now
        if name in sys.modules:
            _patch(name, sys.modules[name])


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != HF and name not in LIGHTNING:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Then(spec.loader, name)
                return spec
        return None


class _Then(importlib.abc.Loader):
    """The module's own loader, then the wrapping."""

    def __init__(self, loader, name: str):
        self._loader, self._name = loader, name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _patch(self._name, module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


def _patch(name: str, module) -> None:
    try:
        trainer = getattr(module, "Trainer", None)
        if trainer is None or getattr(trainer, _WRAPPED, False):
            return
        if name == HF:
            _patch_hf(trainer)
        else:
            _patch_lightning(trainer, name.rsplit(".trainer.", 1)[0])
        setattr(trainer, _WRAPPED, True)
    except Exception:  # noqa: BLE001 - the program runs as it would without nodectl
        pass


def _metrics():
    import nodectl_metrics   # beside this file in lib/

    return nodectl_metrics


def _timed(method, phase: str):
    def wrapper(*args, **kwargs):
        began = time.monotonic()
        try:
            return method(*args, **kwargs)
        finally:
            _metrics().phase(phase, time.monotonic() - began)

    wrapper.__name__, wrapper.__doc__, wrapper.__wrapped__ = method.__name__, method.__doc__, method
    return wrapper


def _reports_itself() -> bool:
    return _metrics().reported_by_script()


def _patch_hf(trainer) -> None:
    from transformers import TrainerCallback

    class _Steps(TrainerCallback):
        loss = None

        def on_log(self, args, state, control, logs=None, **kwargs):
            if isinstance(logs, dict) and isinstance(logs.get("loss"), (int, float)):
                self.loss = logs["loss"]

        def on_step_end(self, args, state, control, **kwargs):
            if not _reports_itself():
                extra = {"loss": self.loss} if self.loss is not None else {}
                _metrics().report(step=state.global_step, _by="transformers.Trainer", **extra)

    init = trainer.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        try:
            self.add_callback(_Steps())
            _metrics().watching(("checkpoint", "eval"), by="transformers.Trainer")
        except Exception:  # noqa: BLE001
            pass

    __init__.__wrapped__ = init
    trainer.__init__ = __init__
    trainer._save_checkpoint = _timed(trainer._save_checkpoint, "checkpoint")
    trainer.evaluate = _timed(trainer.evaluate, "eval")


def _patch_lightning(trainer, package: str) -> None:
    callback_base = sys.modules.get(f"{package}.callbacks.callback")
    if callback_base is None:
        import importlib

        callback_base = importlib.import_module(f"{package}.callbacks.callback")
    by = "Lightning Trainer"

    class _Steps(callback_base.Callback):
        began = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if not _reports_itself():
                _metrics().report(step=trainer.global_step, _by=by)

        def on_validation_start(self, trainer, pl_module):
            self.began = time.monotonic()

        def on_validation_end(self, trainer, pl_module):
            if self.began is not None and not trainer.sanity_checking:
                _metrics().phase("eval", time.monotonic() - self.began)
            self.began = None

    init = trainer.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        try:
            self.callbacks.append(_Steps())
            _metrics().watching(("checkpoint", "eval"), by=by)
        except Exception:  # noqa: BLE001
            pass

    __init__.__wrapped__ = init
    trainer.__init__ = __init__
    trainer.save_checkpoint = _timed(trainer.save_checkpoint, "checkpoint")
