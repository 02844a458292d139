"""Full training checkpoints for exact resume.

Each rank writes its own part: the local shards of the trainable (LoRA) parameters, its optimizer state, and its
RNG states; rank 0 adds the step and the layout. The frozen base is never stored: it is reloaded from its own
files. A checkpoint is written into a `.tmp` folder and renamed only after every rank has finished and rank 0
has written COMPLETE, so a half-written checkpoint is never picked. Files live in each node's own output folder
and need no shared file system (torch.distributed.checkpoint's single metadata file, written by one rank, would).

A save is two halves: `stage` (every rank together: the room check, the whole copy's gather, this rank's state
copied to host memory) and `write` (the files, then every rank's word that its part is written, then COMPLETE and
the rename). `save` runs both; with `train.async_checkpoint`, `Background` runs `write` in a thread while training
goes on, its collectives on a gloo group of their own (torch.distributed.checkpoint's async_save does the same), at
most one in flight.
"""
from __future__ import annotations

import errno
import json
import os
import random
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from . import compile_cache

COMPLETE = "COMPLETE"
REPLICA = "replica.pt"


class ResumeError(Exception):
    pass


class CheckpointError(Exception):
    """A checkpoint could not be written (a full disk, say); the previous complete one is untouched."""


class HostBuffers:
    """Pinned host memory a background save stages into, one buffer per GPU tensor (by its place in the state),
    kept and reused from save to save (at most one is in flight). `reserve` allocates them ahead, in a thread,
    while training runs: pinning many GB takes seconds (6.4 s for 16 GB on an H100 host), which the first save
    would otherwise wait for."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.planned: dict[str, tuple] | None = None   # while planning: key -> (shape, dtype); no copy is made
        self._reserving: threading.Thread | None = None

    def take(self, key: str, like: torch.Tensor) -> torch.Tensor | None:
        if self.planned is not None:
            self.planned[key] = (tuple(like.shape), like.dtype)
            return None
        buffer = self.buffers.get(key)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            buffer = self.buffers[key] = torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
        return buffer.copy_(like, non_blocking=True)

    def reserve(self, model: nn.Module, optimizer) -> None:
        """Walk a save without copying (no collective either), then pin its buffers in a thread."""
        self.planned = {}
        try:
            _local_state(model, optimizer, self)
            if first_here():   # the only rank that keeps the whole copy
                _replica(model, optimizer, self)
        finally:
            planned, self.planned = self.planned, None

        def pin() -> None:
            try:
                for key, (shape, dtype) in planned.items():
                    if key not in self.buffers:
                        self.buffers[key] = torch.empty(shape, dtype=dtype, pin_memory=True)
            except RuntimeError:   # pinned memory refused: the first save allocates what is missing
                pass

        self._reserving = threading.Thread(target=pin, name="checkpoint-pinning", daemon=True)
        self._reserving.start()

    def ready(self) -> None:
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None


DISCARD = object()   # a whole copy this rank gathers (every rank must) but does not keep


def _to_local(value, host=None, key: str = ""):
    """This rank's part on the host: a copy of its own (a CPU tensor is cloned, a GPU one copied down). With `host`
    (HostBuffers, background saves), a GPU tensor goes into its pinned buffer, the copy queued (the caller
    synchronizes once); DISCARD keeps nothing."""
    if hasattr(value, "to_local"):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if host is DISCARD:
            return None
        if value.device.type == "cpu":
            return value.clone() if host is None or host.planned is None else None
        return value.cpu() if host is None else host.take(key, value)
    if isinstance(value, dict):
        return {k: _to_local(v, host, f"{key}/{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_to_local(v, host, f"{key}/{i}") for i, v in enumerate(value)]
    return value


def _local_state(model: nn.Module, optimizer, host=None) -> tuple[dict, dict]:
    """This rank's trainable shards and optimizer state on the host."""
    params = {name: _to_local(p, host, f"params/{name}") for name, p in model.named_parameters() if p.requires_grad}
    return params, _to_local(optimizer.state_dict(), host, "optimizer")


def _rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _full(value, host=None, key: str = ""):
    """The whole tensor behind a shard (a collective for DTensors: every rank calls it in the same order; a
    HostBuffers that plans gathers nothing, the shape is the whole one)."""
    if hasattr(value, "full_tensor"):
        if isinstance(host, HostBuffers) and host.planned is not None:
            return host.take(key, value) if value.device.type != "cpu" else None
        return _to_local(value.full_tensor(), host, key)
    return _to_local(value, host, key) if isinstance(value, torch.Tensor) else value


def _replica(model: nn.Module, optimizer, host=None) -> dict:
    """The trainable state whole: what a run needs to continue on a different number of ranks, e.g. after
    `launch --max-restarts --exclude-failed` dropped a node (whose shards went with it). LoRA state is small;
    the frozen base is never part of it."""
    params = {name: _full(p, host, f"replica/{name}") for name, p in model.named_parameters() if p.requires_grad}
    state = optimizer.state_dict()
    return {"params": params, "param_groups": state["param_groups"],
            "state": {index: {key: _full(value, host, f"replica/{index}/{key}") for key, value in per_param.items()}
                      for index, per_param in state["state"].items()}}


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def staging_bytes(model: nn.Module, optimizer) -> tuple[int, int]:
    """The host memory one save stages: (this rank's shards and optimizer state, the whole copy that each node's
    first rank keeps besides)."""
    trainable = [p for p in model.named_parameters() if p[1].requires_grad]
    local = sum(_tensor_bytes(p.to_local() if hasattr(p, "to_local") else p) for _, p in trainable)
    states = optimizer.state_dict()["state"].values()
    local += sum(_tensor_bytes(v.to_local() if hasattr(v, "to_local") else v) for s in states for v in s.values())
    whole = sum(p.numel() * p.element_size() for _, p in trainable) * 3   # params, Adam's two moments, whole
    return local, whole


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file()) if path.is_dir() else 0


def _gb(count: float) -> str:
    return f"{count / 1e9:.2f} GB" if count >= 1e8 else f"{count / 1e6:.1f} MB"


def room(folder: Path, make_room: bool) -> tuple[int | None, int]:
    """(the bytes this node's next checkpoint needs: its newest complete one's size, None before the first; the
    bytes free under `folder`). With `make_room`, the oldest complete checkpoints are removed first while it
    would not fit, never the newest."""
    kept = sorted(p for p in folder.glob("ckpt-*") if (p / COMPLETE).exists()) if folder.is_dir() else []
    need = _bytes(kept[-1]) if kept else None
    free = shutil.disk_usage(folder if folder.is_dir() else folder.parent).free
    while make_room and need and free < need and len(kept) > 1:
        shutil.rmtree(kept.pop(0), ignore_errors=True)
        free = shutil.disk_usage(folder).free
    return need, free


def no_room(step: int | None, need: int, free: int, folder: Path) -> str:
    """The words for a checkpoint that does not fit on this node."""
    what = f"the checkpoint at step {step}" if step is not None else "the next checkpoint"
    return (f"no space left on node {socket.gethostname()} for {what}: it needs {_gb(need)} (the last one's "
            f"size), {_gb(free)} free under {folder}")


@dataclass(kw_only=True)
class Staged:
    """One checkpoint staged: this rank's part in host memory, ready to be written."""
    step: int
    folder: Path
    need: int | None          # the last complete checkpoint's size on this node (None before the first)
    state: dict               # this rank's file: shards, optimizer state, RNG
    replica: dict | None      # the whole copy, on each node's first rank
    complete: dict            # what COMPLETE says
    keep_last: int
    staged_s: float           # how long training waited for it (Checkpointer adds the wait for the write before)

    @property
    def tmp(self) -> Path:
        return self.folder / f".ckpt-{self.step:07d}.tmp"

    @property
    def final(self) -> Path:
        return self.folder / f"ckpt-{self.step:07d}"


def first_here() -> bool:
    """This node's first rank (LOCAL_RANK 0)."""
    return int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0


def stage(model: nn.Module, optimizer, step: int, folder: Path, device: torch.device, keep_last: int,
          extra: dict | None = None, layout=None, make_room: bool = False, host: HostBuffers | None = None) -> Staged:
    """Every rank calls this at the same step. `layout`: the one the model was wrapped for (Parallel.layout). Each
    node's first rank sets the newest checkpoint's size against the free space first (with `make_room`, dropping old
    ones): a checkpoint that cannot fit on some node is refused on every rank before any is written. With `host`
    (pinned buffers kept between saves), GPU state is copied down without a copy per save being allocated."""
    began = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    if hasattr(model, "reshard"):
        model.reshard()  # store shards, never a parameter left unsharded by an eval forward
    staged = Staged(step=step, folder=folder, need=None, state={}, replica=None, keep_last=keep_last, staged_s=0.0,
                    complete={"step": step, "world_size": world, "layout": layout_key(layout), **(extra or {})})
    need, free = room(folder, make_room) if first_here() else (None, 0)
    staged.need = need
    fits = torch.tensor([0.0 if need and free < need else 1.0], device=device)
    dist.all_reduce(fits, op=dist.ReduceOp.MIN)
    if fits.item() < 1:
        raise CheckpointError((f"rank {rank}: " + no_room(step, need, free, folder) if need and free < need
                               else f"checkpoint at step {step}: another node has no room for it")
                              + "; the previous complete checkpoint is intact: free space (or set "
                                "train.make_room), then resume")
    if rank == 0:
        shutil.rmtree(staged.tmp, ignore_errors=True)
    # Ranks of other nodes see their own file system: each node's first rank prepares its own folder.
    if first_here():
        staged.tmp.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    if host is not None:
        host.ready()   # the buffers pinned ahead (HostBuffers.reserve)
    params, optimizer_state = _local_state(model, optimizer, host)
    # a collective; each node's first rank keeps the whole copy (REPLICA), the others gather it and drop it
    replica = _replica(model, optimizer, host if first_here() else DISCARD)
    staged.state = {"params": params, "optimizer": optimizer_state, "rng": _rng_state(device)}
    staged.replica = replica if first_here() else None
    if host is not None and device.type == "cuda":
        torch.cuda.synchronize(device)   # the queued copies to pinned memory are done: training may change the state
    staged.staged_s = time.perf_counter() - began
    return staged


def write(staged: Staged, device: torch.device, group=None) -> Path:
    """Write a staged checkpoint; every rank calls it for the same one (`group`: the process group its two
    collectives use, on `device`). COMPLETE is written, and the folder renamed, only once every rank's part is."""
    rank, step, folder, tmp = dist.get_rank(), staged.step, staged.folder, staged.tmp
    error = None
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        slow = os.environ.get("NODECTL_TEST_SLOW_CHECKPOINT_WRITE")
        if slow:
            time.sleep(float(slow))   # tests: a disk slow enough that training must go on beside the write
        torch.save(staged.state, tmp / f"rank{rank}.pt")
        if staged.replica is not None:
            torch.save(staged.replica, tmp / REPLICA)
            compile_cache.copy_into(tmp, folder.parent)   # the node's compiled work travels with its checkpoint
    except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as RuntimeError or OSError
        error = f"rank {rank}: {exc}".splitlines()[0]
        left, need = shutil.disk_usage(folder).free, staged.need
        if getattr(exc, "errno", None) == errno.ENOSPC or left < (need or 0) or left < 1 << 20:
            # a full disk, whatever torch's zip writer called it ("unexpected pos ...")
            error = f"rank {rank}: " + (no_room(step, need, left, folder) if need else
                                        f"no space left on node {socket.gethostname()} for the checkpoint at step "
                                        f"{step}: {_gb(left)} free under {folder} once {_gb(_bytes(tmp))} of it "
                                        f"were written")
    crash = os.environ.get("NODECTL_TEST_CRASH_IN_CHECKPOINT")
    if crash and int(crash) == step and rank == 0:
        os._exit(9)  # tests: die with shards written and no COMPLETE marker
    written = torch.tensor([0.0 if error else 1.0], device=device)
    dist.all_reduce(written, op=dist.ReduceOp.MIN, group=group)  # every rank learns whether every part was written
    if written.item() < 1:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"checkpoint at step {step} could not be written to {folder}"
                              + (f" ({error})" if error else " (another rank failed)")
                              + "; the previous complete checkpoint is intact: free space, then resume")
    if first_here():
        (tmp / COMPLETE).write_text(json.dumps(staged.complete))
        os.replace(tmp, staged.final)
        for old in sorted(folder.glob("ckpt-*"))[:-staged.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier(group=group)
    return staged.final


def save(model: nn.Module, optimizer, step: int, folder: Path, device: torch.device, keep_last: int,
         extra: dict | None = None, layout=None, make_room: bool = False) -> Path:
    """Stage and write a checkpoint while training waits (every rank at the same step)."""
    return write(stage(model, optimizer, step, folder, device, keep_last, extra, layout, make_room), device)


class Background:
    """Checkpoints written in a thread while training goes on, one at a time: its collectives run on a gloo group
    of their own (created by every rank together, here), never on the one training uses. Staging waits for the
    write before it (the pinned buffers are reused), as do the end of training and a stop."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo")
        self.host = HostBuffers()
        self._thread: threading.Thread | None = None
        self._staged: Staged | None = None
        self._result: tuple[Path | None, str | None, float] | None = None

    def start(self, staged: Staged) -> None:
        self.wait()
        self._staged, self._result = staged, None
        self._thread = threading.Thread(target=self._write, args=(staged,), name=f"checkpoint-{staged.step}",
                                        daemon=True)
        self._thread.start()

    def _write(self, staged: Staged) -> None:
        began = time.perf_counter()
        try:
            path, error = write(staged, torch.device("cpu"), self.group), None
        except CheckpointError as exc:
            path, error = None, str(exc)
        except Exception as exc:  # noqa: BLE001 - a broken peer mid-write: the checkpoint is not complete
            path, error = None, f"checkpoint at step {staged.step} could not be written: {exc}".splitlines()[0]
        self._result = (path, error, time.perf_counter() - began)

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def failed(self) -> bool:
        """A finished write that failed (on any rank: they agree before they end)."""
        return not self.busy and self._result is not None and self._result[1] is not None

    def finished(self) -> tuple[Staged, Path | None, str | None, float] | None:
        """The write that ended since the last call (staged, path or None, error or None, seconds), once; else None."""
        if self.busy or self._result is None or self._staged is None:
            return None
        staged, (path, error, seconds) = self._staged, self._result
        self._staged = None
        return staged, path, error, seconds

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()


def fits_in_host_memory(local: int, whole: int, device: torch.device) -> tuple[bool, str]:
    """Whether every node holds its ranks' staged checkpoints in memory (pinned, kept between saves) with room to
    spare: each rank's `local` part and one `whole` copy per node. (The answer, agreed by every rank; the figures
    of this node.)"""
    per_node = local * int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1) + whole
    available = _available_memory()
    ok = available is None or per_node <= 0.5 * available
    agreed = torch.tensor([1.0 if ok else 0.0], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    said = f"{_gb(per_node)} per node" + (f" against {_gb(available)} available" if available is not None else "")
    return bool(agreed.item() >= 1), said


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def foresee(folder: Path, make_room: bool) -> str | None:
    """Said after each checkpoint on each node: whether the next one, as large as this one, will fit (with
    `make_room`, counting the old ones it may drop)."""
    kept = sorted(p for p in folder.glob("ckpt-*") if (p / COMPLETE).exists())
    if not kept:
        return None
    need, free = _bytes(kept[-1]), shutil.disk_usage(folder).free
    if make_room:
        free += sum(_bytes(p) for p in kept[:-1])
    if free >= need:
        return None
    return (no_room(None, need, free, folder) + "; free space"
            + (", lower train.keep_checkpoints or set train.make_room: true" if not make_room else "")
            + " before then")


def layout_key(layout) -> str | None:
    """How this run's trainable state is laid out over its ranks (the layout, its node split): a checkpoint
    of another layout is read through its whole copy."""
    return f"{layout.name} {layout.nodes}x{layout.per_node}" if layout is not None else None


def latest(folder: Path) -> Path | None:
    complete = [p for p in sorted(folder.glob("ckpt-*")) if (p / COMPLETE).exists()]
    return complete[-1] if complete else None


def agreed_latest(folder: Path, device: torch.device) -> Path | None:
    """The newest checkpoint every node has complete (nodes keep their own copies)."""
    found = latest(folder)
    step = torch.tensor([int(found.name.split("-")[1]) if found else -1], device=device)
    lowest = step.clone()
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    if lowest.item() < 0:
        return None
    chosen = folder / f"ckpt-{int(lowest.item()):07d}"
    return chosen if (chosen / COMPLETE).exists() else None


def load(model: nn.Module, optimizer, checkpoint: Path, device: torch.device, layout=None) -> int:
    """Restore this rank's shards, optimizer state and RNG; returns the step to continue from. `layout`: the
    one the model was wrapped for (Parallel.layout)."""
    meta = json.loads((checkpoint / COMPLETE).read_text())
    world, rank = dist.get_world_size(), dist.get_rank()
    key = layout_key(layout)
    if meta["world_size"] != world or meta.get("layout", key) != key:
        if not (checkpoint / REPLICA).is_file():
            raise ResumeError(f"{checkpoint} was written by {meta['world_size']} ranks ({meta.get('layout')}); this "
                              f"run has {world} ({key}) and the checkpoint has no {REPLICA} to reshard "
                              f"from. Resume with the same nodes, --gpus and model.parallelism, or start a new run")
        _load_replica(model, optimizer, checkpoint / REPLICA, device)
        if rank == 0:
            print(f"checkpoint of {meta['world_size']} ranks resharded to {world} from its {REPLICA} (layout "
                  f"{meta.get('layout') or 'of an older trainer'} -> {key})", flush=True)
        return meta["step"]
    # mapped, not read: each tensor goes to the device straight from the page cache (a checkpoint written moments
    # before a restart is there), without a first copy of the whole file into memory
    saved = torch.load(checkpoint / f"rank{rank}.pt", map_location="cpu", weights_only=False, mmap=True)
    by_name = dict(model.named_parameters())
    with torch.no_grad():
        for name, local in saved["params"].items():
            param = by_name[name]
            target = param.to_local() if hasattr(param, "to_local") else param
            target.copy_(local.to(target.device))
    state = saved["optimizer"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, per_param in state["state"].items():
        param = params[int(index)]
        for key, value in list(per_param.items()):
            if isinstance(value, torch.Tensor) and value.dim() > 0 and hasattr(param, "device_mesh"):
                from torch.distributed.tensor import DTensor

                per_param[key] = DTensor.from_local(value.to(device), param.device_mesh, param.placements,
                                                    shape=param.shape, stride=param.stride())
            elif isinstance(value, torch.Tensor):
                per_param[key] = value.to(device) if value.dim() > 0 else value
    optimizer.load_state_dict(state)
    _set_rng_state(saved["rng"], device)
    return meta["step"]


def _shard_like(value: torch.Tensor, param, device: torch.device) -> torch.Tensor:
    """`value` (whole) laid out like `param`: this rank's shard as a DTensor, or the tensor itself."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(value.to(device), param.device_mesh, param.placements)
    return value.to(device)


def _load_replica(model: nn.Module, optimizer, path: Path, device: torch.device) -> None:
    """Continue on another number of ranks: every rank reads its node's whole copy and keeps its own shards.
    The data split and random streams follow the new world (the steps go on; the losses are not the ones the
    old world would have logged)."""
    replica = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    by_name = dict(model.named_parameters())
    with torch.no_grad():
        for name, whole in replica["params"].items():
            param = by_name[name]
            shard = _shard_like(whole, param, device)
            target = param.to_local() if hasattr(param, "to_local") else param
            target.copy_(shard.to_local() if hasattr(shard, "to_local") else shard)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, per_param in replica["state"].items():
        param = params[int(index)]
        state[index] = {key: _shard_like(value, param, device) if isinstance(value, torch.Tensor) and value.dim() > 0
                        else value for key, value in per_param.items()}
    optimizer.load_state_dict({"state": state, "param_groups": replica["param_groups"]})
