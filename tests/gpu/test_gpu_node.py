"""Proofs on a GPU machine, as tests (`pytest -m gpu`; skipped where torch sees no CUDA device, as in CI).

Run on the H200 machine as docs/PERFORMANCE.md says: one local node with its GPU, real NCCL. The multi-GPU
proofs (two local "nodes", NVLink, the 8B and MoE figures) stay in bench/gpu_*.sh: they print figures.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run with -m gpu there)")]

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def nodectl(folder: Path, *args: str, timeout: float = 500) -> subprocess.CompletedProcess:
    env = {**os.environ, **NO_MULTICAST, "NODECTL_STATE_DIR": str(folder / "state"), "NODECTL_RUNS": str(folder / "runs")}
    return subprocess.run([sys.executable, "-m", "nodectl", *args], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def gpu_node(tmp_path):
    (tmp_path / "hosts.yaml").write_text(f"nodes:\n  - {{host: localhost, name: gpu0, transport: local, gpus: 1, "
                                         f"python: {sys.executable}, workdir: {tmp_path / 'work'}, "
                                         f"env: {{CUDA_VISIBLE_DEVICES: '0'}}}}\n")
    return tmp_path


def test_preflight_default_tier_passes_with_an_nccl_all_reduce(gpu_node):
    result = nodectl(gpu_node, "--json", "preflight", "hosts.yaml")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    verdicts = {r["check"]: r for r in report["results"]}
    assert verdicts["collective"]["verdict"] == "pass" and "nccl all-reduce correct" in verdicts["collective"]["detail"]
    assert verdicts["gpu perf"]["verdict"] == "pass" and verdicts["torch"]["verdict"] == "pass"
    assert not [r for r in report["results"] if r["verdict"] == "skip" and "reported no" in r["detail"]]


def test_the_demo_trains_on_the_gpu_through_launch(gpu_node):
    result = nodectl(gpu_node, "launch", "--skip-preflight")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    collected = nodectl(gpu_node, "collect")
    assert collected.returncode == 0, collected.stderr
    records = [json.loads(line) for line in
               next((gpu_node / "runs").glob("*/nodes/gpu0/output/metrics.jsonl")).read_text().splitlines()]
    assert records and records[-1]["step"] > 0 and all(r["loss"] == r["loss"] for r in records if "loss" in r)
