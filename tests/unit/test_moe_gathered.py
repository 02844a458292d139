"""The gathered expert exchange (trainer/moe.py, ExpertShard.gathered) on two gloo ranks: every rank holds half
the experts, and the outputs and gradients of its tokens are those of all experts on one rank, whichever way the
exchange runs (model.expert_exchange: host, or graph, eager and compiled in one graph)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from support.trainer_import import trainer_module

TOKENS, HIDDEN, EXPERTS, TOP_K = 12, 8, 4, 2


def _inputs(lopsided: bool = False):
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(2 * TOKENS, HIDDEN, generator=g)
    index = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(2 * TOKENS)])
    index[:TOKENS // 2] = torch.tensor([0, 1])     # rank 0's first tokens go only to rank 0's experts
    if lopsided:                                   # every copy to rank 0's experts: rank 1 computes none
        index = torch.stack([torch.randperm(EXPERTS // 2, generator=g)[:TOP_K] for _ in range(2 * TOKENS)])
    weights = torch.rand(2 * TOKENS, TOP_K, generator=g)
    weight = torch.randn(EXPERTS, HIDDEN, HIDDEN, generator=g)
    probe = torch.randn(2 * TOKENS, HIDDEN, generator=g)
    return hidden, index, weights, weight, probe


def _reference(lopsided: bool):
    """All experts on one rank: each token's sum over its experts of weight x (x @ W_e)."""
    hidden, index, weights, weight, probe = _inputs(lopsided)
    for t in (hidden, weights, weight):
        t.requires_grad_(True)
    out = torch.stack([sum(weights[t, k] * (hidden[t] @ weight[index[t, k]]) for k in range(TOP_K))
                       for t in range(2 * TOKENS)])
    (out * probe).sum().backward()
    return out.detach(), hidden.grad, weights.grad, weight.grad


WAYS = ("host", "graph", "graph-compiled")


def _rank(rank: int, store_path: str, results) -> None:
    moe = trainer_module("moe")
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        # every case in one process group: each start of two ranks costs seconds
        for lopsided, way in [(lopsided, way) for lopsided in (False, True) for way in WAYS]:
            hidden, index, weights, weight, probe = _inputs(lopsided)
            mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
            x = hidden[mine].clone().requires_grad_(True)
            w = weights[mine].clone().requires_grad_(True)
            full = weight.clone().requires_grad_(True)
            shard = moe.ExpertShard(rank, 2, EXPERTS, in_graph=way != "host")
            assert shard.gathers(TOP_K)
            seen = []

            def compute(rows, counts, routed, full=full, shard=shard, seen=seen, way=way):
                if way != "graph-compiled":   # a host read: the compiled way must have none (fullgraph below)
                    seen.append((rows.shape[0], int(counts.sum())))
                offsets = torch.cumsum(counts, 0, dtype=torch.int32)
                return moe.grouped_mm(rows, full[shard.start:shard.stop], offsets) * routed.unsqueeze(-1)

            def forward(x, index, w, shard=shard, compute=compute):
                return shard.gathered(x, index, w, compute)

            if way == "graph-compiled":
                torch._dynamo.reset()
                forward = torch.compile(forward, fullgraph=True, backend="aot_eager")
            out = forward(x, index[mine], w)
            (out * probe[mine]).sum().backward()
            grad = full.grad.clone()
            dist.all_reduce(grad)   # each rank's gradient fills only its own experts
            results[(rank, lopsided, way)] = (out.detach(), x.grad, w.grad, grad, seen)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_the_gathered_exchange_gives_each_rank_what_all_experts_on_one_rank_give(tmp_path):
    """Outputs and the gradients of the tokens, the routing weights and the experts' weights. On the host way each
    rank computes only the copies routed to its own experts (one zero row where none are: grouped GEMMs fail on
    none); on the graph way every copy of the group passes, the others' masked, and compiled it is one graph
    (fullgraph: no host read, no break). Two routings: spread over both ranks' experts, and every copy to rank 0's
    (rank 1 gets none)."""
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    mp.start_processes(_rank, args=(str(tmp_path / "store"), results), nprocs=2, start_method="spawn")
    without = {}   # routing -> the ranks that got no copy
    for lopsided in (False, True):
        out, hidden_grad, weights_grad, weight_grad = _reference(lopsided)
        _, index, *_ = _inputs(lopsided)
        without[lopsided] = []
        for rank, way in [(rank, way) for rank in (0, 1) for way in WAYS]:
            got_out, got_x, got_w, got_weight, seen = results[(rank, lopsided, way)]
            mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
            torch.testing.assert_close(got_out, out[mine], msg=lambda m: f"{way}, lopsided {lopsided}: {m}")
            torch.testing.assert_close(got_x, hidden_grad[mine])
            torch.testing.assert_close(got_w, weights_grad[mine])
            torch.testing.assert_close(got_weight, weight_grad)
            held = int(((index >= rank * 2) & (index < rank * 2 + 2)).sum())
            expected = {"host": [(held, held) if held else (1, 1)], "graph": [(2 * TOKENS * TOP_K, held)],
                        "graph-compiled": []}[way]
            assert seen == expected, (way, lopsided, rank, seen)
            if not held and way == "host":
                without[lopsided].append(rank)
    assert without == {False: [], True: [1]}


def test_the_exchange_is_read_on_the_host_by_default_and_other_ways_are_refused():
    config = trainer_module("config")

    assert config.load_recipe(None, []).model.expert_exchange == "host"
    assert config.load_recipe(None, ["model.expert_exchange=graph"]).model.expert_exchange == "graph"
    with pytest.raises(config.ConfigError, match="model.expert_exchange: expected host or graph, got 'nvshmem'"):
        config.load_recipe(None, ["model.expert_exchange=nvshmem"])
