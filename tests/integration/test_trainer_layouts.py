"""model.parallelism on CPU ranks: every layout trains to FSDP's losses, sends the bytes it says it sends, and
resumes another layout's checkpoint (tests/integration/test_trainer_moe.py has the expert layouts over isolated
SSH nodes)."""
from __future__ import annotations

import os
import shutil
import sys

import pytest

from support import REPO
from support.trainer import metrics, torchrun_nodes

sys.path.insert(0, str(REPO / "bench" / "common"))
from make_moe import write_moe  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory, demo_cache):
    os.environ["NODECTL_DEMO_CACHE"] = str(demo_cache)
    return write_moe(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe")


def test_every_layout_trains_to_fsdps_losses_and_sends_what_it_says(tmp_path, demo_cache, qwen3_moe):
    """2 "nodes" x 2 gloo ranks (two torchrun agents, one rendezvous, each node its own output folder): the base
    sharded inside each node (HSDP) and the experts split inside each node, their tokens' exchange either way
    (model.expert_exchange: host, graph), log FSDP's losses step for step (the
    experts over all four ranks: the isolated-nodes test above); the base replicated goes on from FSDP's step-4
    checkpoint (read through its whole-state copy: another layout) and logs FSDP's steps 5 and 6. Each run counts
    what one step's collectives send; the figure matches the layout's own (ring accounting), and what crosses the
    node boundary under the layouts that keep the all-gathers inside a node is under a quarter of FSDP's."""
    common = [f"model.path={qwen3_moe}", f"data.path={qwen3_moe / 'train.jsonl'}",
              "data.max_length=48", "train.steps=6", "train.log_every=1", "train.lr=0.01", "train.traffic_at=3",
              "train.checkpoint_every=4",
              # 5 held-out rows over 4 ranks: ranks short of rows fill their eval batches (the gathered expert
              # exchange needs every rank's batch of one shape)
              "data.eval_holdout=5", "train.eval_every=2"]
    losses, traffic, evals = {}, {}, {}

    def trained(name: str, *extra: str, layout: str = "") -> list:
        out = tmp_path / name
        procs = torchrun_nodes(2, 2, out, demo_cache, *common, *extra, f"model.parallelism={layout or name}")
        assert all(p.returncode == 0 for p in procs), "\n".join(p.stderr[-2000:] for p in procs)
        assert f"layout: {layout or name} over 2 node(s) x 2 (forced by model.parallelism)" in procs[0].stdout
        records = metrics(out / "node0")
        losses[name] = {m["step"]: m["loss"] for m in records if "loss" in m}
        evals[name] = {m["step"]: m["eval_loss"] for m in records if "eval_loss" in m}
        traffic[name] = next(m for m in records if m.get("event") == "traffic")
        return procs

    for name in ("fsdp", "hsdp", "expert"):
        trained(name)
    # the experts' exchange as it runs inside a compiled layer, nothing read on the host (model.expert_exchange:
    # graph), here uncompiled: tests/unit/test_moe_gathered.py compiles it in one graph (compiling four ranks on
    # two cores would double this run)
    trained("expert-graph", "model.expert_exchange=graph", layout="expert")
    # FSDP's step-4 checkpoint, on each node, continued with the base replicated
    for node in ("node0", "node1"):
        shutil.copytree(tmp_path / "fsdp" / node / "checkpoints" / "ckpt-0000004",
                        tmp_path / "replicate" / node / "checkpoints" / "ckpt-0000004")
    procs = trained("replicate", "train.traffic_at=5")
    assert "resuming at step 4" in procs[0].stdout
    assert "(layout fsdp 2x2 -> replicate 2x2)" in procs[0].stdout

    fsdp = losses["fsdp"]
    assert sorted(fsdp) == [1, 2, 3, 4, 5, 6] and fsdp[6] < 0.9 * fsdp[1]
    assert sorted(losses["replicate"]) == [5, 6] and sorted(evals["replicate"]) == [6]
    for name in ("hsdp", "expert", "expert-graph", "replicate"):
        assert max(abs(loss - fsdp[step]) for step, loss in losses[name].items()) < 1e-4, (name, losses[name], fsdp)
        assert max(abs(loss - evals["fsdp"][step]) for step, loss in evals[name].items()) < 1e-4, evals
    assert sorted(evals["fsdp"]) == sorted(evals["hsdp"]) == sorted(evals["expert"]) == sorted(evals["expert-graph"]) \
        == [2, 4, 6], evals
    assert sorted(losses["expert-graph"]) == [1, 2, 3, 4, 5, 6]
    for name in ("fsdp", "replicate", "hsdp"):  # full rows aside (the exchange's share follows real tokens)
        for kind in ("intra", "inter"):
            counted, said = traffic[name][f"counted_{kind}_node_bytes"], traffic[name][f"layout_{kind}_node_bytes"]
            assert abs(counted - said) <= 0.05 * said, (name, kind, counted, said)
    fsdp_across = traffic["fsdp"]["counted_inter_node_bytes"]
    assert traffic["fsdp"]["layout_fsdp_inter_node_bytes"] == traffic["fsdp"]["layout_inter_node_bytes"]
    for name in ("replicate", "hsdp", "expert"):
        assert 0 < traffic[name]["counted_inter_node_bytes"] < fsdp_across / 4, (name, traffic[name], fsdp_across)


def test_auto_micro_batch_and_checkpointing_say_what_they_chose_and_train_as_that_recipe(tmp_path, demo_cache,
                                                                                       qwen3_moe):
    """train.micro_batch_size: auto over train.batch_size rows, model.activation_checkpointing: auto: rank 0 says
    which split it took and why; the losses are those of the same split written out by hand."""
    import re

    common = [f"model.path={qwen3_moe}", f"data.path={qwen3_moe / 'train.jsonl'}", "data.max_length=48",
              "train.steps=2", "train.log_every=1", "train.lr=0.01"]
    procs = torchrun_nodes(1, 2, tmp_path / "auto", demo_cache, *common, "train.micro_batch_size=auto",
                           "train.batch_size=4", "model.activation_checkpointing=auto")
    assert all(p.returncode == 0 for p in procs), "\n".join(p.stderr[-2000:] for p in procs)
    said = re.search(r"auto: micro-batch (\d) of 4 row\(s\) per step \((\d) accumulated\), (\d+)/(\d+) layers "
                     r"checkpointed: est\. \d+ GB of \d+ GB, [\d.]+ us per token", procs[0].stdout)
    assert said, procs[0].stdout
    micro, accum, checkpointed, layers = map(int, said.groups())
    assert micro * accum == 4 and "layout: replicate over 2 rank(s) (auto: " in procs[0].stdout
    by_hand = torchrun_nodes(1, 2, tmp_path / "by_hand", demo_cache, *common, f"train.micro_batch_size={micro}",
                             f"train.grad_accum={accum}", f"model.activation_checkpointing={checkpointed / layers}")
    assert all(p.returncode == 0 for p in by_hand), "\n".join(p.stderr[-2000:] for p in by_hand)
    auto = [m["loss"] for m in metrics(tmp_path / "auto" / "node0") if "loss" in m]
    assert len(auto) == 2 and auto == [m["loss"] for m in metrics(tmp_path / "by_hand" / "node0") if "loss" in m]
