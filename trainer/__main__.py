"""`python -m trainer --config recipe.yaml [--set section.key=value ...]` under torchrun (or alone)."""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time

from .teardown import leave

# Seconds at most a rank other than 0 waits before leaving on an error every rank found: rank 0 says it and leaves,
# and torchrun's fail-fast ends the others. A fixed few seconds lost the message on a loaded node (rank 0 was still
# loading the model when rank 1 left and torchrun stopped it).
AGREED_ERROR_WAIT = 120.0


@contextlib.contextmanager
def _collector_off():
    """Python's cyclic garbage collector off while the trainer imports torch, transformers and peft. Those imports
    make a few hundred thousand objects that live as long as the process, and the collector walked them again and
    again as they came: a tenth to a sixth of a rank's import CPU time (docs/PERFORMANCE.md, "A trainer rank's
    start"). What the imports made is then frozen out of the collector's later walks. Nothing but module objects is
    made meanwhile: the model's skeleton and its weights come after, with the collector on."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def _import_models_and_adapters() -> None:
    """What the trainer's first steps import anyway (trainer/model.py build_skeleton, loop.train), imported here
    while the collector is off."""
    import peft  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer", description="FSDP2 + LoRA fine-tuning")
    parser.add_argument("--config", help="recipe YAML (default: the built-in demo recipe)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one recipe value (repeatable)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    with _collector_off():
        from .config import ConfigError, load_recipe
        from .data import DataError
        from .resume import CheckpointError
        from .teardown import failed

    rank = int(os.environ.get("RANK", "0"))
    try:
        recipe = load_recipe(args.config, args.set)
        with _collector_off():
            from .loop import train

            _import_models_and_adapters()
        train(recipe)
        import torch.distributed as dist

        if dist.is_initialized():  # no rank tears down its process group while another still uses it: gloo
            dist.barrier()         # aborted a rank at exit ("terminate called without an active exception")
            dist.destroy_process_group()
        if rank == 0:  # after the process group: a merge may outlast any collective timeout
            from .export import export_after_training

            try:
                export_after_training(recipe)
            except OSError as exc:  # a full disk, say: the adapter is saved, the export is not
                print(f"export error: {exc.strerror or exc} ({exc.filename or 'output'}); the adapter is in "
                      f"{recipe.output_dir() / 'adapter'}, export it with python -m trainer.export", file=sys.stderr,
                      flush=True)
                return 1
    except (ConfigError, DataError) as exc:
        if rank == 0:  # every rank reached the same verdict before any collective; one of them says it
            print(f"recipe error: {exc}", file=sys.stderr, flush=True)
        else:          # and leaves first: the others wait, or torchrun's fail-fast could end it before it spoke
            time.sleep(AGREED_ERROR_WAIT)
        return 2
    except CheckpointError as exc:
        if rank == 0 or f"rank {rank}:" in str(exc):
            print(f"checkpoint error: {exc}", file=sys.stderr, flush=True)
        return 1
    except BaseException as exc:  # noqa: BLE001 - any other failure: said first, then out without waiting on peers
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            return 0
        return failed(rank, exc)
    return 0


if __name__ == "__main__":
    # Every end leaves without the interpreter's teardown, its message flushed first. A finished run: under gloo,
    # a torch thread still joinable at teardown aborted about one rank in fifty ("terminate called without an
    # active exception", SIGABRT) after everything was saved. A failure: the process groups are aborted (never
    # destroyed, which waits on peers), so torchrun sees the exit at once and stops the others (teardown.py).
    leave(main())
