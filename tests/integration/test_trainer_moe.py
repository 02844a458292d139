"""Mixture-of-Experts models in the built-in trainer, on tiny random Qwen3-MoE, GLM-4-MoE (shared experts, a dense
first layer) and Mixtral checkpoints saved as the Hub has them (one tensor per expert): LoRA on the routed experts'
fused weights (peft target_parameters), FSDP2 over the MoE layers on two gloo ranks, the adapter reloaded by
PeftModel, and the exports (merged model, vLLM-layout adapter) checked against the trained model's logits."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from support import REPO
from support.trainer import metrics, torchrun
from support.peft_moe import peft_moe as _peft_moe
from support.trainer_import import trainer_module

sys.path.insert(0, str(REPO / "bench" / "common"))
from make_moe import LAYOUTS, write_moe  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory, demo_cache):
    os.environ["NODECTL_DEMO_CACHE"] = str(demo_cache)
    root = tmp_path_factory.mktemp("moe")
    return {layout: write_moe(root / layout, layout) for layout in LAYOUTS}


def _skeleton(model_path: Path, *sets: str):
    config = trainer_module("config")
    recipe = config.load_recipe(None, [f"model.path={model_path}", *sets])
    return trainer_module("model").build_skeleton(recipe, model_path, torch.float32)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_reader_assembles_any_experts_as_transformers_builds_them(moe_models, layout):
    """Rows 1..3 of every fused expert weight, read from the per-expert tensors, equal transformers' own loading."""
    from transformers import AutoModelForCausalLM

    path = moe_models[layout]
    reference = dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).named_parameters())
    skeleton = _skeleton(path)
    checkpoint = trainer_module("weights").Checkpoint(path, skeleton)
    weights = trainer_module("weights")
    fused = [weights.hf_name(n) for n, p in skeleton.named_parameters() if p.dim() == 3]
    assert len(fused) == 2 * (1 if layout == "glm4_moe" else 2)  # GLM's first layer is dense
    for name in fused:
        assert len(checkpoint.source_keys(name)) > 1  # built from several checkpoint tensors
        got = checkpoint.rows(name, 1, 3, tuple(reference[name].shape))
        torch.testing.assert_close(got, reference[name][1:3], rtol=0, atol=0)
    for name, value in reference.items():  # and every other weight, under the model's names
        if value.dim() != 3:
            torch.testing.assert_close(checkpoint.rows(name, 0, value.shape[0] if value.dim() else 0,
                                                       tuple(value.shape)), value, rtol=0, atol=0)
    checkpoint.close()


def test_experts_are_adapted_by_default_and_the_recipe_says_what_is_wrong(moe_models):
    config = trainer_module("config")
    path = moe_models["glm4_moe"]
    model = _skeleton(path)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    # routed experts (fused, through peft's ParamWrapper), shared experts and attention (nn.Linear)
    assert any(".experts.lora_A." in n for n in names) and any(".experts.base_layer.lora_A." in n for n in names)
    assert any("shared_experts.gate_proj.lora_A" in n for n in names)
    assert any("self_attn.q_proj.lora_A" in n for n in names)
    assert not any(".gate.weight" in n for n in names)  # the router stays frozen
    params = dict(model.named_parameters())
    down = params["base_model.model.model.layers.1.mlp.experts.lora_A.default.weight"]
    gate_up = params["base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.default.weight"]
    assert down.shape == (4 * 16, 32)  # every one of the 4 experts gets rank lora.r (16) on down_proj (in: 32)
    assert gate_up.shape == (4 * 2 * 16, 64)  # and 2r on gate_up_proj, which fuses two projections (peft's split)
    assert any("layers.0.mlp.gate_proj.lora_A" in n for n in names)  # the dense first layer's MLP too

    smaller = dict(_skeleton(path, "lora.expert_r=2").named_parameters())
    assert smaller["base_model.model.model.layers.1.mlp.experts.lora_A.default.weight"].shape[0] == 4 * 2
    assert smaller["base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.default.weight"].shape[0] == 4 * 4
    assert smaller["base_model.model.model.layers.1.self_attn.q_proj.lora_A.default.weight"].shape[0] == 16
    frozen = {n for n, _ in _skeleton(path, "lora.target_parameters=none").named_parameters()}
    assert not any(".experts.lora" in n or ".experts.base_layer.lora" in n for n in frozen)
    assert any("shared_experts.gate_proj.lora_A" in n for n in frozen)  # still adapted: not a routed expert

    with pytest.raises(config.ConfigError, match=r"lora.dropout: peft's LoRA on fused expert weights .*set "
                                                 r"lora.dropout: 0"):
        _skeleton(path, "lora.dropout=0.1")
    with pytest.raises(config.ConfigError, match=r"lora.target_parameters: \['mlp.experts.w9'\] names no parameter"
                                                 r".*mlp.experts.down_proj"):
        _skeleton(path, "lora.target_parameters=mlp.experts.w9")


def test_model_flops_count_only_the_experts_a_token_goes_through(moe_models):
    """MFU's parameters: of 4 experts a token goes through top-2, so half of every fused expert weight and half
    of every expert's LoRA factors are idle for it; attention's and the dense layer's adapters are not."""
    model = _skeleton(moe_models["glm4_moe"])
    idle_frozen, idle_trainable = trainer_module("model").inactive_expert_params(model)
    params = dict(model.named_parameters())
    fused = [p for n, p in params.items() if p.dim() == 3]
    expert_lora = [p for n, p in params.items() if ".experts." in n and ".lora_" in n]
    assert fused and expert_lora
    assert idle_frozen == sum(p.numel() for p in fused) // 2
    assert idle_trainable == sum(p.numel() for p in expert_lora) // 2


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_ranks_train_the_experts_and_every_export_reproduces_the_model(tmp_path, demo_cache, moe_models, layout):
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    path = moe_models[layout]
    out = tmp_path / "out"
    recipe = (f"model.path={path}", "train.steps=20", "train.log_every=1", "data.max_length=48")
    proc = torchrun(2, out, demo_cache, *recipe, "train.save_probe_logits=true", "train.export=merged,vllm")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [m["loss"] for m in metrics(out)]
    assert len(losses) == 20 and losses[-1] < 0.8 * losses[0], losses
    assert "exported merged to" in proc.stdout and "exported vllm to" in proc.stdout
    moe_layers = 1 if layout == "glm4_moe" else 2   # GLM's first layer is dense
    assert f"grouped LoRA path in {moe_layers} layer(s)" in proc.stdout   # model.moe_kernel's default
    assert "pattern keys did not match" not in proc.stderr    # peft's false alarm about the experts' ranks
    if layout == "qwen3_moe":   # the other kernel, peft's own path, trains alike step by step (fp32, FSDP over 2)
        other = torchrun(2, tmp_path / "peft", demo_cache, *recipe, "model.moe_kernel=peft")
        assert other.returncode == 0, other.stdout[-3000:] + other.stderr[-3000:]
        assert "grouped LoRA path" not in other.stdout and "pattern keys did not match" not in other.stderr
        by_peft = [m["loss"] for m in metrics(tmp_path / "peft")]
        assert len(by_peft) == 20 and max(abs(a - b) for a, b in zip(losses, by_peft)) < 1e-4, (losses, by_peft)

    with safe_open(str(out / "adapter" / "adapter_model.safetensors"), "pt") as adapter:
        trained = {k: adapter.get_tensor(k) for k in adapter.keys() if ".experts." in k and "shared" not in k}
    assert trained and all(t.abs().max() > 0 for k, t in trained.items() if "lora_B" in k)  # experts learnt

    probe = torch.load(out / "probe.pt")
    mask = probe["attention_mask"].bool()
    inputs = {"input_ids": probe["input_ids"], "attention_mask": probe["attention_mask"]}

    def logits(model) -> torch.Tensor:
        with torch.no_grad():
            return model.eval()(**inputs).logits[mask]

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.testing.assert_close(logits(PeftModel.from_pretrained(base, str(out / "adapter"))), probe["logits"][mask],
                               rtol=1e-4, atol=1e-4)
    merged = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32)
    torch.testing.assert_close(logits(merged), probe["logits"][mask], rtol=1e-4, atol=1e-4)
    untrained = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert not torch.allclose(logits(untrained), probe["logits"][mask], atol=1e-2)

    # The vLLM layout, applied as vLLM applies an adapter (W += lora_alpha / r * B @ A on each named module of
    # the base checkpoint), gives the trained model.
    vllm = out / "adapter-vllm"
    config = json.loads((vllm / "adapter_config.json").read_text())
    assert "target_parameters" not in config
    with safe_open(str(vllm / "adapter_model.safetensors"), "pt") as handle:
        lora = {k: handle.get_tensor(k) for k in handle.keys()}
    expert_modules = {k.split(".experts.")[1].split(".")[1] for k in lora if ".experts." in k and "shared" not in k}
    assert expert_modules == ({"w1", "w2", "w3"} if layout == "mixtral" else {"gate_proj", "up_proj", "down_proj"})
    from safetensors.torch import load_file, save_file

    state = load_file(str(path / "model.safetensors"))
    scale = config["lora_alpha"] / config["r"]
    for key in [k for k in lora if k.endswith(".lora_A.weight")]:
        module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        assert f"{module}.weight" in state, module  # named as in the checkpoint
        delta = scale * lora[key.replace("lora_A", "lora_B")] @ lora[key]
        state[f"{module}.weight"] = state[f"{module}.weight"] + delta
    applied = tmp_path / "vllm-applied"
    applied.mkdir()
    for name in ("config.json",):
        (applied / name).write_text((path / name).read_text())
    save_file(state, str(applied / "model.safetensors"), metadata={"format": "pt"})
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(applied, dtype=torch.float32)),
                               probe["logits"][mask], rtol=1e-4, atol=1e-4)


def test_sliced_and_broadcast_loading_agree_on_experts_split_unevenly(tmp_path, demo_cache, moe_models):
    """model.load: sliced (each rank reads its rows from the node's copy) against broadcast (rank 0 reads all and
    sends the shards): the same losses to the last bit on 3 ranks, where FSDP's chunks are uneven: 4 experts split
    2, 2 and 0 (the last rank reads none), 64-row weights 22, 22 and 20."""
    runs = {}
    for mode in ("sliced", "broadcast"):
        out = tmp_path / mode
        proc = torchrun(3, out, demo_cache, f"model.path={moe_models['qwen3_moe']}", f"model.load={mode}",
                        "train.steps=4", "train.log_every=1", "data.max_length=48", "model.parallelism=fsdp")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert f"weights loaded ({mode})" in proc.stdout
        runs[mode] = [m["loss"] for m in metrics(out)]
    assert runs["sliced"] == runs["broadcast"] and len(runs["sliced"]) == 4


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None or importlib.util.find_spec("wandb") is None,
                    reason="tensorboard and wandb are in the test extra")
def test_metrics_go_to_tensorboard_and_wandb_on_rank_0(tmp_path, demo_cache):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "out"
    secret = "hf_" + "Qx7" * 10  # a token in the ranks' environment must not reach what W&B stores
    os.environ.update(WANDB_MODE="offline", HF_TOKEN=secret)
    try:
        proc = torchrun(2, out, demo_cache, "train.steps=10", "train.log_every=5", "train.tensorboard=true",
                        "train.wandb_project=nodectl-test", "data.max_length=48")
    finally:
        os.environ.pop("WANDB_MODE")
        os.environ.pop("HF_TOKEN")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logged = {m["step"]: m["loss"] for m in metrics(out)}
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    scalars = {e.step: e.value for e in events.Scalars("train/loss")}
    assert scalars.keys() == logged.keys() == {5, 10}
    assert all(abs(scalars[s] - logged[s]) < 1e-5 for s in logged)
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1  # one run, from rank 0, written offline
    record = next(runs[0].glob("*.wandb")).read_bytes()
    assert b"train/loss" in record and b"micro_batch_size" in record and b"nodectl-test" in record
    assert not any(secret.encode() in f.read_bytes() for f in out.rglob("*") if f.is_file())


def test_a_metric_sink_that_is_not_installed_is_a_recipe_error(tmp_path, demo_cache):
    proc = torchrun(1, tmp_path / "out", demo_cache, "train.wandb_project=p", "train.steps=2",
                    pythonpath=(str(_hide("wandb", tmp_path)),))
    assert proc.returncode != 0
    assert "recipe error: train.wandb_project: the wandb package is not installed" in proc.stderr


def _hide(package: str, tmp_path: Path) -> Path:
    """A sitecustomize that makes `package` unfindable, as on a node without it."""
    folder = tmp_path / f"no-{package}"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(
        "import importlib.abc, sys\n"
        "class Hide(importlib.abc.MetaPathFinder):\n"
        f"    def find_spec(self, name, path=None, target=None):\n"
        f"        if name == {package!r} or name.startswith({package + '.'!r}):\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Hide())\n")
    return folder


def _forward_backward(model, ids):
    model.zero_grad()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("layout,targets", [
    ("qwen3_moe", ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")),
    ("glm4_moe", ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")),
    ("mixtral", ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")),
    ("qwen3_moe", ("mlp.experts.down_proj",)),
])
def test_the_grouped_expert_path_gives_peft_outputs_and_gradients(layout, targets):
    """model.moe_kernel: grouped computes base and LoRA on the routed tokens (no B@A); the logits and every
    adapter's gradient equal peft's ParamWrapper path, where each expert's W + scale*B@A is formed."""
    moe = trainer_module("moe")
    model = _peft_moe(layout, targets)
    ids = torch.randint(3, 300, (2, 17), generator=torch.Generator().manual_seed(1))
    logits, grads = _forward_backward(model, ids)
    covered, skipped = moe.install(model)
    assert covered == (1 if layout == "glm4_moe" else 2) and skipped == []  # GLM's first layer is dense
    fast_logits, fast_grads = _forward_backward(model, ids)
    torch.testing.assert_close(fast_logits, logits, rtol=1e-5, atol=1e-5)
    expert_grads = [n for n in grads if ".experts." in n and "lora_" in n]
    assert len(expert_grads) == 2 * len(targets) * covered
    for name in grads:
        assert fast_grads[name].abs().max() > 0, name
        torch.testing.assert_close(fast_grads[name], grads[name], rtol=1e-4, atol=1e-6, msg=name)


def _scaled_grouped_mm_as_documented(a, b, scale_a, scale_b, offs=None, bias=None, scale_result=None,
                                     out_dtype=None, use_fast_accum=False):
    """torch._scaled_grouped_mm's product for a 2-D a and 3-D b (CUDA-only in torch): rows offs[g-1]:offs[g] of
    a * scale_a times b[g] * scale_b[g], per column; the layout and scales trainer/fp8.py hands it are checked here,
    the kernel itself on the GPU (bench/moe/fp8_experts.py)."""
    assert a.dtype == b.dtype == torch.float8_e4m3fn and a.is_contiguous() and b.transpose(-2, -1).is_contiguous()
    assert scale_a.shape == (a.shape[0],) and scale_b.shape == (b.shape[0], b.shape[2])
    out, start = torch.zeros(a.shape[0], b.shape[2]), 0
    for group, stop in enumerate(offs.tolist()):
        out[start:stop] = (a[start:stop].float() * scale_a[start:stop, None]) @ (b[group].float() * scale_b[group])
        start = stop
    return out.to(out_dtype)


def test_fp8_experts_compute_what_the_bf16_weights_do_within_e4m3s_precision(monkeypatch):
    """model.fp8_experts: each frozen expert stack becomes two e4m3 copies (forward and input gradient), its bf16
    storage released (shape and count kept); logits and every adapter gradient stay those of the full-precision
    grouped path within e4m3's 3 mantissa bits; peft's own forward (a merged adapter) is refused rather than run on
    the released weights."""
    moe = trainer_module("moe")
    model = _peft_moe("qwen3_moe", ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
    ids = torch.randint(3, 300, (2, 17), generator=torch.Generator().manual_seed(1))
    moe.install(model)
    logits, grads = _forward_backward(model, ids)
    stacks = {n: p.shape for n, p in model.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))}
    assert moe.quantize_experts(model) == len(stacks) == 4
    after = dict(model.named_parameters())
    for name, shape in stacks.items():
        assert after[name].shape == shape and after[name].untyped_storage().nbytes() <= 4, name
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _scaled_grouped_mm_as_documented, raising=False)
    fast_logits, fast_grads = _forward_backward(model, ids)
    assert 0 < (fast_logits - logits).norm() / logits.norm() < 0.05
    for name in grads:
        error = (fast_grads[name] - grads[name]).norm() / grads[name].norm()
        assert error < 0.1, (name, float(error))
    wrapper = next(m for m in model.modules() if type(m) is moe.grouped_wrapper_type())
    wrapper.merged_adapters.append("default")   # as after merge_adapter: peft's own forward would read W
    with pytest.raises(RuntimeError, match="model.fp8_experts"):
        model(input_ids=ids)


def test_the_grouped_path_leaves_merged_and_disabled_adapters_to_peft():
    moe = trainer_module("moe")
    model = _peft_moe("qwen3_moe", ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
    ids = torch.randint(3, 300, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
        moe.install(model)
        with model.disable_adapter():
            torch.testing.assert_close(model(input_ids=ids).logits, base, rtol=1e-5, atol=1e-5)
        model.merge_adapter()  # the delta is in the weights now: no adapter on top
        torch.testing.assert_close(model(input_ids=ids).logits, adapted, rtol=1e-4, atol=1e-4)
        model.unmerge_adapter()
        torch.testing.assert_close(model(input_ids=ids).logits, adapted, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(adapted, base, atol=1e-3)


def test_expert_parallel_over_two_isolated_nodes_trains_as_without_it(ssh_cluster, tmp_path, demo_cache, moe_models):
    """model.expert_parallel: 4 experts over 2 nodes x 2 gloo ranks, one expert per rank, each rank holding only
    its expert's weights; tokens travel to their experts by all_to_all, across the node boundary too. Over 30
    steps the losses are those of the same four ranks under FSDP; the adapter reloads in peft and reproduces the
    trained model's logits."""
    import shutil

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from support.cli import run_nodectl
    from support.launch import kill_leftovers, latest_run_id

    project = tmp_path / "project"
    shutil.copytree(moe_models["qwen3_moe"], project / "model")
    import yaml

    recipe = yaml.safe_load(trainer_module("config").DEMO_RECIPE.read_text())  # what torchrun() below starts from
    for section, values in {"model": {"path": "model", "expert_parallel": True},
                            "data": {"path": "model/train.jsonl", "max_length": 48},
                            "train": {"steps": 30, "log_every": 1, "lr": 0.01, "save_probe_logits": True}}.items():
        recipe[section].update(values)
    (project / "recipe.yaml").write_text(json.dumps(recipe))
    inventory = ssh_cluster.inventory(count=2, env={"NODECTL_DEMO_CACHE": str(demo_cache)})
    result = run_nodectl(["-i", str(inventory), "launch", "--skip-preflight", "--gpus", "2", "--config",
                          "recipe.yaml"], env=ssh_cluster.env(), cwd=project, timeout=300)
    run_id = latest_run_id(project)
    kill_leftovers(run_id)
    assert result.exit_code == 0, result.output[-3000:]
    out = ssh_cluster.nodes[0].workdir / "runs" / run_id / "output"
    sharded = [m["loss"] for m in metrics(out)]

    plain = tmp_path / "plain"
    proc = torchrun(4, plain, demo_cache, f"model.path={moe_models['qwen3_moe']}",
                    f"data.path={moe_models['qwen3_moe'] / 'train.jsonl'}", "data.max_length=48", "train.steps=30",
                    "train.log_every=1", "train.lr=0.01", "model.parallelism=fsdp")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reference = [m["loss"] for m in metrics(plain)]
    assert "layout: expert-global over 2 node(s) x 2" in result.output
    assert len(sharded) == 30 and sharded[-1] < 0.5 * sharded[0]
    assert max(abs(a - b) for a, b in zip(sharded, reference)) < 1e-4, (sharded, reference)

    probe = torch.load(out / "probe.pt")
    mask = probe["attention_mask"].bool()
    base = AutoModelForCausalLM.from_pretrained(moe_models["qwen3_moe"], dtype=torch.float32)
    with torch.no_grad():
        reloaded = PeftModel.from_pretrained(base, str(out / "adapter")).eval()(
            input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits[mask]
    torch.testing.assert_close(reloaded, probe["logits"][mask], rtol=1e-4, atol=1e-4)


def test_expert_parallel_recipe_errors(tmp_path, demo_cache, moe_models):
    config = trainer_module("config")
    with pytest.raises(config.ConfigError, match="model.expert_parallel: needs model.moe_kernel: grouped"):
        config.load_recipe(None, ["model.expert_parallel=true", "model.moe_kernel=peft"])
    with pytest.raises(config.ConfigError, match="model.expert_parallel: each rank reads its own experts"):
        config.load_recipe(None, ["model.expert_parallel=true", "model.load=broadcast"])
    proc = torchrun(3, tmp_path / "out", demo_cache, f"model.path={moe_models['qwen3_moe']}",
                    "model.expert_parallel=true", "train.steps=2")
    assert proc.returncode != 0
    assert "recipe error: model.parallelism: 4 experts do not split evenly over 3 ranks" in proc.stderr


def test_expert_parallel_checkpoints_resume_exactly_and_on_fewer_ranks(tmp_path, demo_cache, moe_models):
    """With the experts split over 2 ranks, a run stopped at its step-4 checkpoint and resumed logs the same
    losses as a straight run; the same checkpoint continues on 1 rank (which then holds every expert)."""
    import shutil

    common = [f"model.path={moe_models['qwen3_moe']}", "model.expert_parallel=true", "data.max_length=48",
              "train.log_every=1", "train.lr=0.01", "train.checkpoint_every=4"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    for out, steps in ((straight, 8), (stopped, 4), (stopped, 8)):
        proc = torchrun(2, out, demo_cache, *common, f"train.steps={steps}")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resuming at step 4" in proc.stdout
    def losses(out):
        return {m["step"]: m["loss"] for m in metrics(out) if "loss" in m}  # not the checkpoint events

    by_step = losses(stopped)
    assert [by_step[s] for s in range(1, 9)] == [losses(straight)[s] for s in range(1, 9)]

    fewer = tmp_path / "fewer"
    shutil.copytree(stopped / "checkpoints" / "ckpt-0000004", fewer / "checkpoints" / "ckpt-0000004")
    proc = torchrun(1, fewer, demo_cache, *common, "train.steps=8")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resuming at step 4" in proc.stdout
    continued = losses(fewer)
    assert sorted(continued) == [5, 6, 7, 8] and continued[8] < by_step[4]

