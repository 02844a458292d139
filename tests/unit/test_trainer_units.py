"""Trainer pieces without processes: recipe parsing, label masking, the deterministic data order."""
from __future__ import annotations

import pytest

from support.trainer_import import trainer_module

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
    with pytest.raises(config.ConfigError, match="model.moe_kernel: expected grouped or peft, got 'fast'"):
        config.load_recipe(None, ["model.moe_kernel=fast"])
    recipe = config.load_recipe(None, ["train.steps=3", "lora.target_modules=q_proj,v_proj"])
    assert recipe.train.steps == 3 and recipe.lora.target_modules == ("q_proj", "v_proj")


def test_async_checkpoint_takes_a_switch_or_auto_and_refuses_what_host_memory_cannot_hold(monkeypatch):
    """train.async_checkpoint: true, false or auto, anything else a recipe error; the staged state of a node's ranks
    must fit its available memory twice over, agreed by every rank, and says its figures either way."""
    import torch
    import torch.distributed as dist

    load = trainer_module("config").load_recipe
    assert load(None, []).train.async_checkpoint == "auto"
    assert load(None, ["train.async_checkpoint=false"]).train.async_checkpoint is False
    assert load(None, ["train.async_checkpoint=true"]).train.async_checkpoint is True
    with pytest.raises(config.ConfigError, match="train.async_checkpoint: expected true, false or auto, got 'later'"):
        load(None, ["train.async_checkpoint=later"])

    resume = trainer_module("resume")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(resume, "_available_memory", lambda: 100 * 10**9)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        # 8 ranks' parts and one whole copy a node
        assert resume.fits_in_host_memory(5 * 10**9, 8 * 10**9, torch.device("cpu")) == (
            True, "48.00 GB per node against 100.00 GB available")
        assert resume.fits_in_host_memory(6 * 10**9, 8 * 10**9, torch.device("cpu")) == (
            False, "56.00 GB per node against 100.00 GB available")
    finally:
        dist.destroy_process_group()


def test_activation_checkpointing_takes_a_switch_or_a_share_of_layers():
    model_cfg = trainer_module("config").load_recipe
    assert model_cfg(None, ["model.activation_checkpointing=false"]).model.activation_checkpointing is False
    assert model_cfg(None, ["model.activation_checkpointing=0.25"]).model.activation_checkpointing == 0.25
    with pytest.raises(config.ConfigError, match="model.activation_checkpointing: expected true, false, a share of the layers from 0 to 1 or auto"):
        model_cfg(None, ["model.activation_checkpointing=1.5"])
    layers = trainer_module("model").checkpointed_layers
    assert layers(32, True) == list(range(32)) and layers(32, False) == []
    assert layers(32, 0.25) == [0, 4, 8, 12, 16, 20, 24, 28]
    assert len(layers(5, 0.5)) == 2


@pytest.mark.parametrize("head_kind", ["frozen", "lora", "lora-in-model"])
def test_chunked_head_loss_matches_the_full_logits_loss_and_gradients(head_kind, monkeypatch):
    """The loss paths that never hold the batch's full-vocabulary logits give Hugging Face's loss and the same
    gradients (the hidden states' and the adapter's), across chunk boundaries, with ignored targets: a frozen head
    takes the fused path; a LoRA layer on it, alone or inside its model, the checkpointed one."""
    import torch
    import torch.nn.functional as F

    loss = trainer_module("loss")
    monkeypatch.setattr(loss, "CHUNK_ROWS", 7)
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False).requires_grad_(False)
    if head_kind != "frozen":
        import peft

        model = peft.get_peft_model(torch.nn.Sequential(head), peft.LoraConfig(r=4, target_modules=["0"]))
        head = model if head_kind == "lora-in-model" else model.base_model.model[0]
        torch.nn.init.normal_(model.base_model.model[0].lora_B.default.weight)
    hidden = torch.randn(3, 9, 16, dtype=torch.float64, requires_grad=True)
    head = head.double()
    adapter = [p for p in head.parameters() if p.requires_grad]
    assert len(adapter) == (0 if head_kind == "frozen" else 2)
    labels = torch.randint(0, 50, (3, 9))
    labels[0, :4] = -100
    labels[2, -2:] = -100

    got = loss.head_loss_sum(hidden, head, labels)
    got_grads = torch.autograd.grad(got * 0.5, [hidden, *adapter])
    logits = head(hidden)
    want = F.cross_entropy(logits[:, :-1].reshape(-1, 50), labels[:, 1:].reshape(-1), reduction="sum")
    want_grads = torch.autograd.grad(want * 0.5, [hidden, *adapter])
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_grads[0], want_grads[0])
    for got_grad, want_grad in zip(got_grads[1:], want_grads[1:], strict=True):  # through the fp32 upcast
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6)
    assert got_grads[0][0, :3].abs().sum() == 0  # positions whose next token is ignored get no gradient
    with torch.no_grad():
        torch.testing.assert_close(loss.head_loss_sum(hidden, head, labels), want.float().detach())


def test_mfu_formula_counts_attention_from_real_row_lengths_both_ways():
    metrics = trainer_module("metrics")
    trainable, matmul, layers, hidden = 1_000, 50_000, 2, 16
    # two rows of 3 and 5 real tokens
    dense = (4 * matmul + 2 * trainable) * 8
    attention = 12 * layers * hidden * (3 ** 2 + 5 ** 2)
    assert metrics.window_flops(trainable, matmul, layers, hidden, 8, 34, causal=False) == dense + attention
    assert metrics.window_flops(trainable, matmul, layers, hidden, 8, 34, causal=True) == dense + attention / 2
    # rows of one length: the per-token formula of the README
    assert metrics.window_flops(trainable, matmul, layers, hidden, 8, 2 * 4 ** 2, causal=False) == \
        8 * metrics.flops_per_token(trainable, matmul, layers, hidden, 4)


def tiny_llama(attn: str = "sdpa"):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_packed_row_gives_each_document_its_unpacked_loss(attn):
    """Three documents packed into one row (and a second, shorter row, so the batch is padded): every document's
    summed loss equals the loss of that document alone. Before, packing let documents attend across a boundary."""
    import torch

    loss = trainer_module("loss")
    model = tiny_llama(attn)
    generator = torch.Generator().manual_seed(1)
    docs = [data.Example(tuple(t), (-100,) + tuple(t[1:])) for t in
            (torch.randint(3, 64, (n,), generator=generator).tolist() for n in (9, 14, 6, 5))]
    rows = data.pack(docs, max_length=30)
    assert [len(r.input_ids) for r in rows] == [29, 5] and rows[0].positions[:10] == tuple(range(9)) + (0,)
    assert round(data.packing_efficiency(rows, 30), 3) == round(34 / 60, 3)

    def doc_loss(logits, labels):
        return loss.logits_loss_sum(logits, labels)

    with torch.no_grad():
        alone = [doc_loss(model(input_ids=torch.tensor([d.input_ids])).logits, torch.tensor([d.labels]))
                 for d in docs]
        batch = data.collate(rows, pad_id=0)
        # as the trainer calls it (loss.attach): no cache, no mask, the positions
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        bounds = [(0, 9), (9, 23), (23, 29)]
        packed = [doc_loss(logits[:1, a:b], batch["labels"][:1, a:b]) for a, b in bounds]
        packed.append(doc_loss(logits[1:, :5], batch["labels"][1:, :5]))
        for got, want in zip(packed, alone):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # the same row without per-document positions (what packing did before) mixes the documents
        mixed = model(input_ids=batch["input_ids"][:1, :29], use_cache=False).logits
        assert not torch.allclose(doc_loss(mixed[:, 9:23], batch["labels"][:1, 9:23]), alone[1], atol=1e-3)


def test_every_rank_trains_and_evaluates_on_batches_of_one_shape():
    """An expert layout's ranks all-gather their tokens, which needs as many on every rank: each micro-batch is
    padded to the widest row any rank has in that micro step (every rank reads the shared example list, nothing is
    sent), and an eval batch is filled to the batch size with rows whose labels are ignored."""
    import torch
    import torch.distributed as dist

    data, evaluate = trainer_module("data"), trainer_module("evaluate")
    examples = [data.Example(tuple(range(1, n + 1)), tuple(range(1, n + 1))) for n in (3, 9, 4, 5, 2, 7, 6, 8, 3)]
    shapes, widest = {}, {}
    for rank in range(2):
        batches = data.StepBatches(examples, micro_batch_size=2, grad_accum=2, world_size=2, rank=rank, seed=0,
                                   pad_id=0)
        shapes[rank] = [[tuple(b["input_ids"].shape) for b in batches.micro_batches(step)] for step in range(4)]
        widest[rank] = [[max(len(examples[i].input_ids) for i in batches.indices(step, m)) for m in range(2)]
                        for step in range(4)]
    assert shapes[0] == shapes[1]
    assert [[w for _, w in step] for step in shapes[0]] == [[max(a, b) for a, b in zip(*pair)]
                                                            for pair in zip(widest[0], widest[1])]
    assert any(a != b for x, y in zip(widest[0], widest[1]) for a, b in zip(x, y))   # the rows did differ

    class Model:   # a loss of 1 per token it is asked to predict
        seen: list = []

        def eval(self):
            pass

        def train(self):
            pass

        def loss_sum(self, input_ids, attention_mask, labels, positions):
            self.seen.append(tuple(input_ids.shape))
            return (labels[:, 1:] != data.IGNORE).sum().float()

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:   # the all-reduce is over this one process; each call plays one of two ranks' shares
        per_rank = {rank: (Model.seen.clear(), evaluate.evaluate(Model(), examples[1:6], rank=rank, world=2,
                                                                 batch_size=2, pad_id=0,
                                                                 device=torch.device("cpu")), list(Model.seen))
                    for rank in range(2)}
    finally:
        dist.destroy_process_group()
    # rows 9, 4, 5, 2, 7 wide over two ranks: rank 0 has 9, 5 | 7 and rank 1 has 4, 2 | nothing; the second
    # batches are filled with the first row (9 wide)
    assert per_rank[0][2] == per_rank[1][2] == [(2, 9), (2, 9)]
    assert per_rank[0][1] == per_rank[1][1] == 1.0                # filled rows count no token


def test_an_expert_shard_that_receives_no_row_still_computes_on_one_and_returns_none():
    """Expert parallelism: a micro-batch whose tokens all go to other ranks' experts leaves this rank with no row.
    grouped_mm's backward fails on an empty input on GPUs (4 H200s, step 12: "Invalid strides/sizes"), so the
    shard computes on one zero row more and drops it: the output is empty, the gradients are zero and finite."""
    import torch
    import torch.distributed as dist

    moe = trainer_module("moe")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        shard = moe.ExpertShard(rank=0, world=1, num_experts=4)
        weight = torch.randn(4, 8, 8, requires_grad=True)
        seen = []

        def compute(rows, counts):
            seen.append((rows.shape[0], counts.tolist()))
            return moe.grouped_mm(rows, weight, torch.cumsum(counts, 0, dtype=torch.int32))

        rows = torch.zeros(0, 8, requires_grad=True)
        out = shard.exchange(rows, torch.zeros(4), compute)
        out.sum().backward()
        assert out.shape == (0, 8) and seen == [(1, [0, 0, 0, 1])]
        assert weight.grad is not None and torch.all(weight.grad == 0)
        some = torch.randn(5, 8, requires_grad=True)
        again = shard.exchange(some, torch.tensor([2.0, 0.0, 3.0, 0.0]), compute)
        direct = moe.grouped_mm(some, weight, torch.tensor([2, 2, 5, 5], dtype=torch.int32))
        assert torch.allclose(again, direct) and seen[-1] == (5, [2, 0, 3, 0])   # the zero row only when empty
    finally:
        dist.destroy_process_group()


def test_the_exchange_reorders_rows_with_a_gradient_that_gathers_as_indexing_would_scatter():
    """The expert exchange puts the received rows in expert order and back with a permutation whose backward is
    the inverse permutation (a gather), not indexing's accumulating scatter: the same values and gradients."""
    import torch

    moe = trainer_module("moe")
    x = torch.randn(7, 3, requires_grad=True)
    order = torch.randperm(7)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(7)
    weight = torch.randn(7, 3)
    ours = moe._Permute.apply(x, order, inverse, 1)
    (ours * weight).sum().backward()
    expected = x.detach().clone().requires_grad_(True)
    (expected[order] * weight).sum().backward()
    assert torch.equal(ours, expected[order]) and torch.equal(x.grad, expected.grad)
    assert torch.equal(moe._Permute.apply(ours, inverse, order, 1), x)


def test_compiled_combine_sums_each_tokens_copies_as_the_eager_form_both_ways():
    """Compiled, the routed copies' sum is spelt as top_k gathers added up (a pointwise kernel, not a reduction
    across rows): the same values as gathering then summing, forward and through dispatch's gradient, and for
    the expert layout's partial sums, where a copy computed on another rank adds nothing."""
    import torch

    moe = trainer_module("moe")
    tokens, top_k, hidden = 24, 4, 16
    order = torch.randperm(tokens * top_k)
    restore = torch.empty_like(order)
    restore[order] = torch.arange(order.numel())
    scale = torch.rand(tokens * top_k, 1)
    grad = torch.randn(tokens, hidden)

    def layer(x):
        return moe._Combine.apply(moe._Dispatch.apply(x, order, restore, top_k) * scale, order, restore, top_k)

    x = torch.randn(tokens, hidden, requires_grad=True)
    eager = layer(x)
    eager.backward(grad)
    expected = x.detach()[order // top_k] * scale
    expected = expected[restore].view(tokens, top_k, hidden).sum(dim=1)
    assert torch.allclose(eager, expected, atol=1e-6)
    compiled_x = x.detach().clone().requires_grad_(True)
    compiled = torch.compile(layer, backend="aot_eager")(compiled_x)
    compiled.backward(grad)
    assert torch.allclose(compiled, eager, atol=1e-5) and torch.allclose(compiled_x.grad, x.grad, atol=1e-5)
    # x's gradient: each token's copies' scales summed (dispatch's adjoint is the same sum)
    per_token = scale[restore].view(tokens, top_k).sum(dim=1, keepdim=True)
    assert torch.allclose(x.grad, grad * per_token, atol=1e-5)
    # the expert layout's sum of the copies this rank computed (the others add nothing), and its gradient
    copies = torch.randperm(tokens * top_k)[: tokens * top_k // 2]
    rows = torch.randn(copies.numel(), hidden, requires_grad=True)

    def summed(r):
        return moe._SumCopies.apply(r, copies, tokens, top_k)

    expected = torch.zeros(tokens * top_k, hidden).index_copy(0, copies, rows.detach())
    expected = expected.view(tokens, top_k, hidden).sum(dim=1)
    compiled_rows = rows.detach().clone().requires_grad_(True)
    compiled = torch.compile(summed, backend="aot_eager")(compiled_rows)
    compiled.backward(grad)
    assert torch.allclose(compiled, expected, atol=1e-5)
    assert torch.equal(compiled_rows.grad, grad[copies // top_k])


def _shape(**changes):
    layout = trainer_module("layout")
    qwen3 = dict(frozen_bytes=int(61.1e9), trainable=int(997e6), expert_bytes=int(57.8e9), layers=48, hidden=2048,
                 checkpointed=5, tokens=8192, top_k=8, mlp_ratio=3.0)   # Qwen3-30B-A3B, 2 x 4096, 10% checkpointed
    return layout.Shape(**{**qwen3, **changes})


def test_auto_layout_replicates_what_fits_keeps_shards_inside_nodes_and_says_why():
    layout = trainer_module("layout")
    h200, h100 = 150.1e9, 85.0e9
    chosen = layout.choose("auto", _shape(), h200, 4, 1, 4)
    assert chosen.name == "replicate" and "61.1 GB" in chosen.reason and "nothing to all-gather" in chosen.reason
    assert "fits on every GPU" in chosen.reason
    on_cpu = layout.choose("auto", _shape(), None, 4, 1, 4, unit="rank")   # a CPU run is not labelled as GPUs
    assert "fits on every rank" in on_cpu.reason and "GPU" not in on_cpu.reason
    assert layout.choose("auto", _shape(), h100, 4, 1, 4).name == "fsdp"       # 61 GB of base does not fit twice
    glm = _shape(frozen_bytes=int(213.8e9), trainable=int(1.83e9), expert_bytes=int(202e9), layers=46, hidden=4096,
                 checkpointed=46, tokens=4096, mlp_ratio=2.75)
    two_nodes = layout.choose("auto", glm, h200, 4, 2, 2)
    assert two_nodes.name == "hsdp" and two_nodes.two_d and "only gradient shards cross" in two_nodes.reason
    assert layout.choose("auto", glm, h200, 4, 1, 4).name == "fsdp"            # one node: hsdp is fsdp
    assert layout.choose("auto", glm, h100, 4, 2, 2).name == "fsdp"            # half the base per GPU: too big
    assert layout.choose("auto", _shape(), h200, 1, 1, 1).name == "replicate"
    too_big = layout.choose("auto", _shape(tokens=8192 * 16), h100, 4, 1, 4)
    assert too_big.name == "fsdp" and "lower train.micro_batch_size" in too_big.reason
    forced = layout.choose("expert", _shape(), h200, 4, 2, 2)
    assert forced.name == "expert" and forced.expert_group_size == 2 and forced.reason == "forced by model.parallelism"
    config = trainer_module("config")
    with pytest.raises(config.ConfigError, match="expert needs a Mixture-of-Experts model"):
        layout.choose("expert", _shape(top_k=0, expert_bytes=0), h200, 4, 1, 4)
    # a torch whose FSDP cannot keep weights out (before 2.7): never replicate, and forcing it says why
    assert layout.choose("auto", _shape(), h200, 4, 1, 4, leaves_out=False).name == "fsdp"
    with pytest.raises(config.ConfigError, match="replicate needs torch >= 2.7"):
        layout.choose("replicate", _shape(), h200, 4, 1, 4, leaves_out=False)


def test_auto_splits_the_routed_experts_inside_the_node_where_the_base_does_not_fit_whole():
    """Where the whole base does not fit on each GPU and the routed experts run on the grouped path, auto splits
    them over the node's GPUs (2 to top-k of them: the gathered exchange) rather than sharding them with the rest:
    GLM-4.5-Air's shape ran 1.40x faster so on 2 H200s. Where the base fits, replicate stays first."""
    layout = trainer_module("layout")
    h200 = 150.1e9
    glm = _glm(experts=128, grouped=True)
    one_node = layout.choose("auto", glm, h200, 4, 1, 4)
    assert one_node.name == "expert" and one_node.expert_group_size == 4
    assert "routed experts (202.0 GB) split over a node's 4 GPUs and never gathered" in one_node.reason
    assert "does not fit whole on every GPU" in one_node.reason
    two_nodes = layout.choose("auto", glm, h200, 4, 2, 2)
    assert two_nodes.name == "expert" and two_nodes.two_d and two_nodes.expert_group_size == 2
    assert layout.choose("auto", _shape(experts=128, grouped=True), h200, 4, 1, 4).name == "replicate"
    # not where the experts stay on peft's path, nor past top-k GPUs a node, nor where they do not split evenly
    assert layout.choose("auto", _glm(experts=128), h200, 4, 1, 4).name == "fsdp"
    assert layout.choose("auto", _glm(experts=128, grouped=True, top_k=2), h200, 4, 1, 4).name == "fsdp"
    assert layout.choose("auto", _glm(experts=60, grouped=True), h200, 8, 1, 8).name == "fsdp"
    assert layout.choose("auto", glm, h200, 4, 1, 4, leaves_out=False).name == "fsdp"
    # the measured run: 32 of GLM-4.5-Air's layers on 2 H200s, 2 rows a step: expert, micro-batch 1, nothing
    # checkpointed (5,359-5,369 tokens/s per GPU against fsdp's 3,832-3,841 at 2 x 4096, all checkpointed)
    glm32 = _glm(layers=32, checkpointed=32, trainable=int(1.26e9), frozen_bytes=int(148.1e9),
                 expert_bytes=int(137.3e9), active_bytes=int(148.1e9 - 137.3e9 * (1 - 8 / 128)), experts=128,
                 grouped=True)
    chosen, split = layout.plan("auto", glm32, h200, 2, 1, 2, rows=2, max_length=4096, micro=None, share=None)
    assert chosen.name == "expert" and (split.micro, split.share) == (1, 0.0)
    assert f"est. {split.need / 1e9:.0f} GB" in chosen.reason and split.need >= 130.0e9   # its measured peak


def _glm(**changes):
    return _shape(**{**dict(frozen_bytes=int(213.8e9), trainable=int(1.83e9), expert_bytes=int(202e9), layers=46,
                            hidden=4096, checkpointed=46, tokens=4096, mlp_ratio=2.75,
                            active_bytes=int(213.8e9 - 202e9 * (1 - 8 / 128))), **changes})


def test_the_split_estimate_ranks_the_measured_runs_as_they_ran():
    """seconds_per_token against the runs of docs/PERFORMANCE.md (tokens/s per GPU on H200s): GLM-4.5-Air over 4
    GPUs, 2 x 4096 half checkpointed (3,151) and 1 x 4096 all checkpointed (2,078); Qwen3-30B-A3B alone, 2 x 4096
    with 5 of 48 layers checkpointed (15,205-15,567). Within 10% of each, and in their order."""
    layout = trainer_module("layout")
    qwen = _shape(active_bytes=int(61.1e9 - 57.8e9 * (1 - 8 / 128)))
    estimates = {"glm mb2 half": layout.seconds_per_token("fsdp", _glm(tokens=8192, checkpointed=23), 4, 1, 4),
                 "glm mb1 all": layout.seconds_per_token("fsdp", _glm(), 4, 1, 4),
                 "qwen mb2 10%": layout.seconds_per_token("replicate", qwen, 1, 1, 1)}
    measured = {"glm mb2 half": 1 / 3151, "glm mb1 all": 1 / 2078, "qwen mb2 10%": 1 / 15386}
    for run, seconds in estimates.items():
        assert abs(seconds / measured[run] - 1) < 0.10, (run, seconds * 1e6, measured[run] * 1e6)
    assert estimates["glm mb2 half"] < estimates["glm mb1 all"]


def test_the_memory_estimate_holds_what_the_expert_layouts_gathered_exchange_keeps():
    """The expert layout on 2 H200s (docs/PERFORMANCE.md): Qwen3-30B-A3B, 2 x 4096, 5 of 48 layers checkpointed,
    peaked at 106.5 GB while the partial sums were placed in a zero-filled buffer, 83.4 GB since; GLM-4.5-Air's 32
    layers, 1 x 4096, nothing checkpointed, 146.6 then 130.0. A split that auto takes must fit for real: the
    estimate holds both, with no more than a quarter to spare."""
    layout = trainer_module("layout")
    qwen = layout.per_gpu_bytes("expert", _shape(), 2, 2)
    assert 83.4e9 <= qwen <= 1.3 * 83.4e9
    glm = layout.per_gpu_bytes("expert", _glm(layers=32, checkpointed=0, tokens=4096, trainable=int(1.26e9),
                                             frozen_bytes=int(148.1e9), expert_bytes=int(137.3e9)), 2, 2)
    assert 130.0e9 <= glm <= 1.3 * 130.0e9
    # groups above top-k exchange by all_to_all and keep no gathered copies; replicate none at all
    assert layout.per_gpu_bytes("expert-global", _shape(top_k=2), 4, 4) < \
        layout.per_gpu_bytes("expert-global", _shape(top_k=4), 4, 4)
    assert layout.per_gpu_bytes("replicate", _shape(), 2, 2) < qwen + 61.1e9 / 2


def test_auto_split_picks_the_fastest_micro_batch_and_checkpointing_that_fit_and_says_why():
    layout = trainer_module("layout")
    h200, h100 = 150.1e9, 85.0e9
    qwen = _shape(active_bytes=int(61.1e9 - 57.8e9 * (1 - 8 / 128)))
    chosen, split = layout.plan("auto", qwen, h200, 1, 1, 1, rows=4, max_length=4096, micro=None, share=None)
    assert chosen.name == "replicate" and split.micro == 2 and split.need <= layout.FITS * h200
    assert split.reason.startswith("auto: micro-batch 2 of 4 row(s) per step (2 accumulated), ")
    assert " GB of 150 GB, " in split.reason and "; next: micro-batch" in split.reason
    # a micro-batch given: the least checkpointing that fits beside it, as fast as anything that fits
    _, given = layout.plan("auto", qwen, h200, 1, 1, 1, rows=4, max_length=4096, micro=4, share=None)
    assert given.micro == 4 and 0 < given.share < 1 and given.need <= layout.FITS * h200
    less = [s for s in layout.CHECKPOINT_SHARES if s < given.share]
    assert all(layout.per_gpu_bytes("replicate", _shape(tokens=4 * 4096, checkpointed=round(s * 48)), 1, 1)
               > layout.FITS * h200 for s in less)
    # GLM over 4 GPUs: sharded; never the smallest, slowest split when a larger one fits
    chosen, split = layout.plan("auto", _glm(), h200, 4, 1, 4, rows=4, max_length=4096, micro=None, share=None)
    assert chosen.name == "fsdp" and (split.micro, split.share) != (1, 1.0) and split.need <= layout.FITS * h200
    # the layout's own reason is the one for the chosen split
    assert f"est. {split.need / 1e9:.0f} GB" in chosen.reason
    # nothing fits: the smallest split, said so
    _, squeezed = layout.plan("auto", _glm(), h100, 2, 1, 2, rows=4, max_length=4096, micro=None, share=None)
    assert (squeezed.micro, squeezed.share) == (1, 1.0) and "nothing fits by the estimate" in squeezed.reason


def test_recipe_auto_split_settings_are_checked():
    config = trainer_module("config")
    recipe = config.load_recipe(None, ["train.micro_batch_size=auto", "train.batch_size=8",
                                       "model.activation_checkpointing=auto"])
    assert recipe.train.micro_batch_size == "auto" and recipe.model.activation_checkpointing == "auto"
    with pytest.raises(config.ConfigError, match="micro_batch_size: auto splits train.batch_size"):
        config.load_recipe(None, ["train.micro_batch_size=auto"])
    with pytest.raises(config.ConfigError, match="leave train.grad_accum unset"):
        config.load_recipe(None, ["train.micro_batch_size=auto", "train.batch_size=8", "train.grad_accum=2"])
    with pytest.raises(config.ConfigError, match=r"train.batch_size: 6 rows per step is not .* \(4 x 1\)"):
        config.load_recipe(None, ["train.micro_batch_size=4", "train.batch_size=6"])
    assert config.load_recipe(None, ["train.micro_batch_size=4", "train.grad_accum=2",
                                     "train.batch_size=8"]).train.batch_size == 8
    with pytest.raises(config.ConfigError, match="train.micro_batch_size: expected a positive integer or auto"):
        config.load_recipe(None, ["train.micro_batch_size=most"])
    with pytest.raises(config.ConfigError, match="expected true, false, a share of the layers from 0 to 1 or auto"):
        config.load_recipe(None, ["model.activation_checkpointing=some"])


def test_layout_bytes_keep_the_heavy_traffic_inside_the_node():
    """Per GPU and step, GLM-4.5-Air over 2 x 2: whole-world FSDP all-gathers the base across the node boundary;
    HSDP and the node-local expert split send only the adapter gradients' shards across it."""
    layout = trainer_module("layout")
    glm = _shape(frozen_bytes=int(213.8e9), trainable=int(1.83e9), expert_bytes=int(202e9), layers=46, hidden=4096,
                 checkpointed=46, tokens=4096, mlp_ratio=2.75)
    sent = {name: layout.traffic(layout.Layout(name, 4, 2, 2, ""), glm, True)
            for name in ("fsdp", "hsdp", "expert", "expert-global", "replicate")}
    across = {name: figures["inter_node_bytes"] for name, figures in sent.items()}
    assert across["fsdp"] > 150e9                                             # 2 x 213.8 GB gathered, half across
    assert across["hsdp"] == across["expert"] == across["replicate"] == pytest.approx(4 * 1.83e9 / 2)
    assert across["expert-global"] > 5 * across["expert"]                     # tokens cross the node boundary
    assert sent["expert"]["intra_node_bytes"] < sent["hsdp"]["intra_node_bytes"]  # experts never gathered


def test_fp8_experts_are_refused_where_they_cannot_run_with_what_to_change():
    """model.fp8_experts needs the grouped expert path, a layout in which FSDP does not shard (and gather in bf16)
    the experts, and a GPU with torch's FP8 grouped GEMM: each missing one is named before any process group."""
    import torch

    config, layout, loop = trainer_module("config"), trainer_module("layout"), trainer_module("loop")
    with pytest.raises(config.ConfigError, match="model.fp8_experts: needs model.moe_kernel: grouped"):
        config.load_recipe(None, ["model.fp8_experts=true", "model.moe_kernel=peft"])
    assert config.load_recipe(None, ["model.fp8_experts=true"]).model.fp8_experts is True
    cpu = loop.Context(rank=0, world=2, local_rank=0, device=torch.device("cpu"), on_gpu=False)
    with pytest.raises(config.ConfigError, match="the fsdp layout shards the experts' frozen weights through FSDP; "
                                                 "set model.parallelism: replicate or expert"):
        loop._check_fp8(layout.Layout("fsdp", 2, 1, 2, "auto"), cpu)
    for allowed in ("replicate", "expert", "expert-global"):
        with pytest.raises(config.ConfigError, match="model.fp8_experts: FP8 grouped GEMMs need a CUDA GPU"):
            loop._check_fp8(layout.Layout(allowed, 2, 1, 2, "forced"), cpu)
    with pytest.raises(config.ConfigError, match="FP8 grouped GEMMs need a CUDA GPU"):
        loop._check_fp8(layout.Layout("fsdp", 1, 1, 1, "one rank"), cpu)   # one rank: nothing sharded


def test_recipe_refuses_unknown_or_contradicting_layouts():
    config = trainer_module("config")
    with pytest.raises(config.ConfigError, match="model.parallelism: expected one of auto, replicate, hsdp"):
        config.load_recipe(None, ["model.parallelism=zero3"])
    with pytest.raises(config.ConfigError, match="contradicts model.parallelism: hsdp"):
        config.load_recipe(None, ["model.expert_parallel=true", "model.parallelism=hsdp"])
    with pytest.raises(config.ConfigError, match="model.parallelism: needs model.moe_kernel: grouped"):
        config.load_recipe(None, ["model.parallelism=expert", "model.moe_kernel=peft"])
    assert config.load_recipe(None, ["model.expert_parallel=true"]).model.layout == "expert-global"
    assert config.load_recipe(None, []).model.layout == "auto"
