"""What one step really sends: every collective torch.distributed is asked for during the step, counted by group
and size (FSDP's all-gathers and reduce-scatters, the expert exchange's all_to_all, the trainer's own
all-reduces), with the same ring accounting as layout.traffic (layout.ring_split), so the layout's figure is
checked against the calls the step made. Counting wraps torch.distributed's functions for one step only and never waits on the GPU.
torch's functional collectives are not counted: the expert layout's exchange with model.expert_exchange: graph runs
them inside compiled layers, so its bytes are the layout's figure alone."""
from __future__ import annotations

import contextlib
import os
import threading

import torch
import torch.distributed as dist

from .layout import ring_split

RING = {"all_gather_single": ("ring", 0), "all_gather_into_tensor": ("ring", 0),
        "reduce_scatter_single": ("ring", 1), "reduce_scatter_tensor": ("ring", 1),
        "all_reduce": ("reduce", 0), "all_to_all_single": ("a2a", 1)}

TENSOR_KEYWORDS = ("output", "output_tensor", "input", "input_tensor", "tensor")


class Counter:
    def __init__(self) -> None:
        self.intra = self.inter = 0.0
        self.calls = 0
        self._depth = threading.local()
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or dist.get_world_size()
        self._node = lambda rank: rank // per_node

    def add(self, kind: str, tensor: torch.Tensor, group, splits) -> None:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        size = len(ranks)
        if size < 2:
            return
        me = dist.get_rank()
        total = tensor.numel() * tensor.element_size()
        self.calls += 1
        if kind == "a2a":
            row = total / max(1, tensor.shape[0]) if tensor.dim() else 0
            parts = [s * row for s in splits] if splits else [total / size] * size
            for peer, part in zip(ranks, parts):
                if peer != me:
                    if self._node(peer) == self._node(me):
                        self.intra += part
                    else:
                        self.inter += part
            return
        sent = total * (size - 1) / size * (2 if kind == "reduce" else 1)
        inside, across = ring_split(sent, size, len({self._node(r) for r in ranks}))
        self.intra += inside
        self.inter += across

    def wrap(self, name: str, original):
        kind, which = RING[name]

        def counted(*args, **kwargs):
            depth = getattr(self._depth, "value", 0)
            if depth == 0:
                tensors = [a for a in args if isinstance(a, torch.Tensor)] + [
                    kwargs[k] for k in TENSOR_KEYWORDS if isinstance(kwargs.get(k), torch.Tensor)]
                tensor = tensors[which] if len(tensors) > which else tensors[0] if tensors else None
                group = kwargs.get("group")
                if group is None:
                    group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
                splits = kwargs.get("input_split_sizes")
                if splits is None and name == "all_to_all_single" and len(args) > 3:
                    splits = args[3]
                if tensor is not None:
                    self.add(kind, tensor, group, list(splits) if splits else None)
            self._depth.value = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth.value = depth

        return counted


@contextlib.contextmanager
def counting():
    """Counts this rank's collectives inside the block; yields the Counter."""
    counter = Counter()
    saved = {name: getattr(dist, name) for name in RING if hasattr(dist, name)}
    for name, original in saved.items():
        setattr(dist, name, counter.wrap(name, original))
    try:
        yield counter
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)
