"""How a rank leaves: its message out first, then no waiting on its peers.

A failure on one rank must end that rank within seconds so torchrun's fail-fast stops the run: an exception that
ran `destroy_process_group()` first (under NCCL it waits while the peers sit in a collective) hid its traceback and
hung the whole run. So the traceback, with the rank and its node, is printed and flushed before anything that can
block; the process groups are then aborted (torch's abort: no collective), within a bound; and the process exits
without the interpreter's teardown, which can wait on the same communicators.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import traceback

ABORT_SECONDS = 5.0


def failed(rank: int, exc: BaseException) -> int:
    """Say what ended this rank (a traceback, unless it is one of the trainer's own exits); its exit code."""
    if isinstance(exc, SystemExit):   # the trainer's own exits (after SIGTERM and its checkpoint): their code
        return exc.code if isinstance(exc.code, int) else 1
    node = os.environ.get("NODECTL_NODE_RANK", "?")
    print(f"rank {rank} (node rank {node}, {socket.gethostname()}) failed:", file=sys.stderr, flush=True)
    traceback.print_exception(exc, file=sys.stderr)
    return 1


def leave(code: int) -> None:
    """Flush, abort the process groups on a failure, and exit with `code` at once."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code != 0:
        abort_process_groups(ABORT_SECONDS)
    os._exit(code)


def abort_process_groups(seconds: float) -> None:
    """Every process group aborted (torch's `_abort_process_group`), in a thread bounded by `seconds`: the
    process exits after it whatever happened there."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None:
        return
    worker = threading.Thread(target=_quietly, args=(abort,), daemon=True)
    worker.start()
    worker.join(seconds)


def _quietly(call) -> None:
    try:
        call()
    except Exception:  # noqa: BLE001 - a backend without an abort: the exit that follows ends it anyway
        pass
