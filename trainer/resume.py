"""Full training checkpoints for exact resume.

Each rank writes its own part: the local shards of the trainable (LoRA) parameters, its optimizer state, and its
RNG states; rank 0 adds the step and the layout. The frozen base is never stored: it is reloaded from its own
files. A checkpoint is written into a `.tmp` folder and renamed only after every rank has finished and rank 0
has written COMPLETE, so a half-written checkpoint is never picked. Files live in each node's own output folder
and need no shared file system (torch.distributed.checkpoint's single metadata file, written by one rank, would).
"""
from __future__ import annotations

import errno
import json
import os
import random
import shutil
import socket
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

COMPLETE = "COMPLETE"
REPLICA = "replica.pt"


class ResumeError(Exception):
    pass


class CheckpointError(Exception):
    """A checkpoint could not be written (a full disk, say); the previous complete one is untouched."""


def _to_local(value):
    if hasattr(value, "to_local"):
        return value.to_local().detach().cpu().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _to_local(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_local(v) for v in value]
    return value


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


def _full(value):
    """The whole tensor behind a shard (a collective for DTensors: every rank calls it in the same order)."""
    if hasattr(value, "full_tensor"):
        return value.full_tensor().detach().cpu()
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def _replica(model: nn.Module, optimizer) -> dict:
    """The trainable state whole: what a run needs to continue on a different number of ranks, e.g. after
    `launch --max-restarts --exclude-failed` dropped a node (whose shards went with it). LoRA state is small;
    the frozen base is never part of it."""
    params = {name: _full(p) for name, p in model.named_parameters() if p.requires_grad}
    state = optimizer.state_dict()
    return {"params": params, "param_groups": state["param_groups"],
            "state": {index: {key: _full(value) for key, value in per_param.items()}
                      for index, per_param in state["state"].items()}}


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


def save(model: nn.Module, optimizer, step: int, folder: Path, device: torch.device, keep_last: int,
         extra: dict | None = None, layout=None, make_room: bool = False) -> Path:
    """Every rank calls this at the same step. `layout`: the one the model was wrapped for (Parallel.layout).
    Each node's first rank sets the newest checkpoint's size against the free space first (with `make_room`,
    dropping old ones): a checkpoint that cannot fit on some node is refused on every rank before any is written."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if hasattr(model, "reshard"):
        model.reshard()  # store shards, never a parameter left unsharded by an eval forward
    final, tmp = folder / f"ckpt-{step:07d}", folder / f".ckpt-{step:07d}.tmp"
    first_here = int(os.environ.get("LOCAL_RANK", rank)) == 0
    need, free = room(folder, make_room) if first_here else (None, 0)
    fits = torch.tensor([0.0 if need and free < need else 1.0], device=device)
    dist.all_reduce(fits, op=dist.ReduceOp.MIN)
    if fits.item() < 1:
        raise CheckpointError((f"rank {rank}: " + no_room(step, need, free, folder) if need and free < need
                               else f"checkpoint at step {step}: another node has no room for it")
                              + "; the previous complete checkpoint is intact: free space (or set "
                                "train.make_room), then resume")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    # Ranks of other nodes see their own file system: each node's first rank prepares its own folder.
    if int(os.environ.get("LOCAL_RANK", rank)) == 0:
        tmp.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    params = {name: _to_local(p) for name, p in model.named_parameters() if p.requires_grad}
    replica = _replica(model, optimizer)  # collective; each node's first rank keeps a copy (REPLICA)
    error = None
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        torch.save({"params": params, "optimizer": _to_local(optimizer.state_dict()), "rng": _rng_state(device)},
                   tmp / f"rank{rank}.pt")
        if int(os.environ.get("LOCAL_RANK", rank)) == 0:
            torch.save(replica, tmp / REPLICA)
    except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as RuntimeError or OSError
        error = f"rank {rank}: {exc}".splitlines()[0]
        left = shutil.disk_usage(folder).free
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
    dist.all_reduce(written, op=dist.ReduceOp.MIN)  # every rank learns whether every part was written
    if written.item() < 1:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"checkpoint at step {step} could not be written to {folder}"
                              + (f" ({error})" if error else " (another rank failed)")
                              + "; the previous complete checkpoint is intact: free space, then resume")
    if int(os.environ.get("LOCAL_RANK", rank)) == 0:
        (tmp / COMPLETE).write_text(json.dumps({"step": step, "world_size": world, "layout": layout_key(layout),
                                                **(extra or {})}))
        os.replace(tmp, final)
        for old in sorted(folder.glob("ckpt-*"))[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


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
    saved = torch.load(checkpoint / f"rank{rank}.pt", map_location="cpu", weights_only=False)
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
    replica = torch.load(path, map_location="cpu", weights_only=False)
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
