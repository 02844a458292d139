"""Proofs on a GPU machine, as tests (`pytest -m gpu`; skipped where torch sees no CUDA device, as in CI).

Run on the H200 machine as docs/PERFORMANCE.md says: one local node with its GPU, real NCCL. The multi-GPU
proofs (two local "nodes", NVLink, the 8B and MoE figures) stay in bench/gpu_*.sh: they print figures.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from support.cli import CLIResult, nodectl_in

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run with -m gpu there)")]

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def nodectl(folder: Path, *args: str, timeout: float = 500) -> CLIResult:
    return nodectl_in(folder, *args, env=NO_MULTICAST, timeout=timeout)


@pytest.fixture
def gpu_node(tmp_path):
    (tmp_path / "hosts.yaml").write_text(f"nodes:\n  - {{host: localhost, name: gpu0, transport: local, gpus: 1, "
                                         f"python: {sys.executable}, workdir: {tmp_path / 'work'}, "
                                         f"env: {{CUDA_VISIBLE_DEVICES: '0'}}}}\n")
    return tmp_path


def test_preflight_default_tier_passes_with_an_nccl_all_reduce(gpu_node):
    result = nodectl(gpu_node, "--json", "preflight", "hosts.yaml")
    assert result.exit_code == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    verdicts = {r["check"]: r for r in report["results"]}
    assert verdicts["collective"]["verdict"] == "pass" and "nccl all-reduce correct" in verdicts["collective"]["detail"]
    assert verdicts["gpu perf"]["verdict"] == "pass" and verdicts["torch"]["verdict"] == "pass"
    assert not [r for r in report["results"] if r["verdict"] == "skip" and "reported no" in r["detail"]]


def test_the_demo_trains_on_the_gpu_through_launch(gpu_node):
    result = nodectl(gpu_node, "launch", "--skip-preflight")
    assert result.exit_code == 0, result.stdout[-3000:] + result.stderr[-3000:]
    collected = nodectl(gpu_node, "collect")
    assert collected.exit_code == 0, collected.stderr
    records = [json.loads(line) for line in
               next((gpu_node / "runs").glob("*/nodes/gpu0/output/metrics.jsonl")).read_text().splitlines()]
    assert records and records[-1]["step"] > 0 and all(r["loss"] == r["loss"] for r in records if "loss" in r)


NCCL_QUEUED = '''\
import os
import torch
import torch.distributed as dist

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
tensor = torch.ones(1 << 20, device="cuda")
for _ in range(3):
    dist.all_reduce(tensor)
torch.cuda.synchronize()
print("hung from here", flush=True)
torch.cuda._sleep(int(4e11))   # the GPU spins for minutes: the next all_reduce waits behind it on the stream
dist.all_reduce(tensor)
torch.cuda.synchronize()
'''


def test_diagnose_reads_the_nccl_flight_recorder_of_a_live_rank(gpu_node):
    """One GPU, one NCCL rank: its 4th all_reduce is queued behind a kernel that spins for minutes. The listener
    answers from inside the process; the NCCL recorder's entry is read with its state, and the GPU is busy."""
    import time

    (gpu_node / "queued.py").write_text(NCCL_QUEUED)
    started = nodectl(gpu_node, "launch", "--skip-preflight", "--detach", "--", "queued.py")
    assert started.exit_code == 0, started.stdout[-3000:] + started.stderr[-3000:]
    try:
        deadline = time.monotonic() + 120
        while "hung from here" not in nodectl(gpu_node, "tail", "rank0").stdout:
            assert time.monotonic() < deadline, nodectl(gpu_node, "tail", "rank0", "-n", "40").stdout
            time.sleep(1)
        time.sleep(8)
        result = nodectl(gpu_node, "--json", "diagnose")
        assert result.exit_code == 0, result.stdout[-3000:] + result.stderr[-3000:]
        found = json.loads(result.stdout)
        print(json.dumps({k: found[k] for k in ("kind", "summary", "evidence", "gpus", "seconds")}, indent=1))
        if os.environ.get("NODECTL_SAVE_DUMPS"):   # how tests/data/diagnose/nccl-*/ was made
            target = Path(os.environ["NODECTL_SAVE_DUMPS"]) / "queued"
            target.mkdir(parents=True, exist_ok=True)
            for saved in (gpu_node / found["folder"]).glob("*.json"):
                (target / saved.name).write_text(saved.read_text())
        rank = found["ranks"][0]
        assert any(v.startswith("nccl") for v in rank["flight_recorder"]), rank
        assert rank["waits_in"]["backend"] == "nccl" and rank["waits_in"]["op"] == "all_reduce"
        assert rank["waits_in"]["state"] in ("scheduled", "started")
        assert rank["last_completed"]["0"] == rank["waits_in"]["seq"] - 1
        assert found["kind"] == "network" and "nccl" in found["summary"]
        assert found["gpus"]["gpu0"][0]["util"] > 50
    finally:
        nodectl(gpu_node, "stop", "--grace", "1")
