"""The routed experts' LoRA in Triton (trainer/expert_lora.py, model.expert_lora_kernel): its output and all four
gradients against a float64 expert-by-expert reference, and a whole peft MoE model's logits and adapter gradients
against torch's grouped path. On a CUDA GPU the kernels run compiled in bf16; elsewhere in Triton's interpreter
(TRITON_INTERPRET=1, float32), in a child process that alone sees the Triton scripts/setup.sh puts in .triton/ (the
variable must be set before triton is imported, and the suite's other processes stay without it)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
TESTS = HERE.parents[1]
sys.path.insert(0, str(TESTS))


TRITON = TESTS.parent / ".triton"   # scripts/setup.sh installs Triton here, outside the venv


def _run(check: str) -> None:
    if torch.cuda.is_available():
        pytest.importorskip("triton")
        CHECKS[check]("cuda")
        return
    if not (TRITON / "triton").is_dir():
        pytest.skip(f"no Triton in {TRITON} (scripts/setup.sh installs it there)")
    path = os.pathsep.join(map(str, (TESTS, TESTS.parent, TRITON)))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, str(HERE), check], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"{check}: ok" in proc.stdout, proc.stdout[-3000:]


def _reference(x, a, b, base, counts, scale):
    """base + scale * (x @ A_e^T) @ B_e, expert by expert."""
    pieces, start = [], 0
    for expert, count in enumerate(counts):
        pieces.append(base[start:start + count] + scale * (x[start:start + count] @ a[expert].T) @ b[expert])
        start += count
    return torch.cat(pieces) if pieces else base[:0]


def _kernel_matches_reference(device: str) -> None:
    from trainer import expert_lora

    dtype, tolerance = (torch.bfloat16, 2e-2) if device == "cuda" else (torch.float32, 1e-5)
    generator = torch.Generator().manual_seed(0)
    # experts without rows, partial row tiles, an expert over several tiles; rank below tl.dot's 16, at it, odd
    for counts, rank in (([0, 70, 3, 130, 0, 64], 16), ([5, 0, 200, 1], 4), ([17, 90, 0, 33, 64, 1, 2], 24),
                         ([0, 0, 0], 8)):
        experts, k, n, scale = len(counts), 96, 80, 2.0
        rows = sum(counts)
        draw = [torch.randn(*shape, generator=generator) for shape in
                ((rows, k), (experts, rank, k), (experts, rank, n), (rows, n), (rows, n))]
        x, a, b, base = (t.to(device, dtype).requires_grad_() for t in draw[:4])
        grad = draw[4].to(device, dtype)
        offsets = torch.tensor(counts).cumsum(0).to(device, torch.int32)
        ends = expert_lora.tile_ends(torch.tensor(counts, device=device))
        out = expert_lora.add_lora(base, x, a.transpose(1, 2), b, scale, offsets, ends)
        out.backward(grad)
        exact = [t.detach().double().requires_grad_() for t in draw[:4]]
        want = _reference(*exact, counts, scale)
        want.backward(draw[4].double())
        for name, got, ref in zip(("out", "dx", "dA", "dB", "dbase"), (out, x.grad, a.grad, b.grad, base.grad),
                                  (want, *(t.grad for t in exact))):
            assert got.shape == ref.shape, (name, counts, rank)
            error = float((got.detach().double().cpu() - ref.detach()).norm() / ref.norm().clamp(min=1e-12))
            assert error < tolerance, (name, counts, rank, error)
            if rows:
                assert ref.norm() > 0, name


def _model_matches_torch_grouped_path(device: str) -> None:
    """Qwen3-MoE with LoRA on gate_up (r 8) and down (r 4): logits and every adapter's gradient as torch's grouped
    GEMMs give them; the experts' adapters get gradients at all."""
    from support.peft_moe import peft_moe
    from trainer import moe

    ids = torch.randint(3, 300, (2, 17), generator=torch.Generator().manual_seed(1), device="cpu").to(device)
    results = {}
    for kernel in ("torch", "triton"):
        model = peft_moe("qwen3_moe", ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")).to(device)
        covered, _ = moe.install(model, kernel)
        assert covered == 2
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        results[kernel] = out.logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    (logits, grads), (fast_logits, fast_grads) = results["torch"], results["triton"]
    torch.testing.assert_close(fast_logits, logits, rtol=1e-5, atol=1e-5)
    expert_grads = [n for n in grads if ".experts." in n and "lora_" in n]
    assert len(expert_grads) == 8
    for name in grads:
        assert fast_grads[name].abs().max() > 0, name
        torch.testing.assert_close(fast_grads[name], grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_auto_takes_torchs_products_on_every_device_and_other_values_are_refused():
    from trainer import config, moe

    assert moe.lora_kernel("auto") == "torch"
    assert moe.lora_kernel("torch") == "torch" and moe.lora_kernel("triton") == "triton"
    assert config.load_recipe(None, []).model.expert_lora_kernel == "auto"
    with pytest.raises(config.ConfigError, match="model.expert_lora_kernel: expected auto, triton or torch"):
        config.load_recipe(None, ["model.expert_lora_kernel=cuda"])


CHECKS = {"kernel": _kernel_matches_reference, "model": _model_matches_torch_grouped_path}


@pytest.mark.slow
def test_the_kernels_give_the_reference_output_and_gradients():
    _run("kernel")


@pytest.mark.slow
def test_a_moe_model_on_the_triton_kernels_trains_as_on_torchs_grouped_path():
    _run("model")


if __name__ == "__main__":  # python tests/unit/test_expert_lora.py kernel|model [cuda]: one check, as _run does
    CHECKS[sys.argv[1]](sys.argv[2] if len(sys.argv) > 2 else "cpu")
    print(f"{sys.argv[1]}: ok")
