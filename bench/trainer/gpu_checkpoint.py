"""How long training waits for a checkpoint: written while it waits (train.async_checkpoint: false, the trainer
before background writes) against written in the background (true), in one call, A B B A by default.

    python3 bench/trainer/gpu_checkpoint.py --work /tmp/ck [--r 256] [--steps 32] [--every 10] [--order sync,async,async,sync]

One GPU, the built-in trainer under torchrun: an 8B-shaped Llama from random weights (model.init: random, no file),
LoRA of rank --r on every linear layer (rank 192: 0.5 B trainable parameters; a checkpoint of the shards, Adam's
two moments and the whole copy is about 12 GB, the size the goodput issue measured), rows of --seq tokens. Each
run's folder is removed once read (two checkpoints of that size at a time). For each run: the stall the trainer reports
(`checkpoint_s`: staging, or the whole write), the background write's own seconds, the checkpoint's bytes, and the
stall as the wall clock shows it: the time between the checkpoint step's log record and the next one's, less the
median time between records of steps without a checkpoint.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from nodectl.resources.launchers.ports import quiet_port  # noqa: E402


def one(mode: str, args, work: Path, model: Path, index: int) -> dict:
    out = work / f"run{index}-{mode}"
    recipe = work / f"recipe-{index}.json"
    recipe.write_text(json.dumps({
        "model": {"path": str(model), "init": "random", "activation_checkpointing": True, "dtype": "bfloat16"},
        "lora": {"r": args.r, "alpha": 2 * args.r, "dropout": 0.0},
        "data": {"path": str(model / "train.jsonl"), "max_length": args.seq},
        "train": {"steps": args.steps, "micro_batch_size": 1, "log_every": 1, "warmup_steps": 2, "lr": 1e-4,
                  "checkpoint_every": args.every, "checkpoint_minutes": 0, "keep_checkpoints": 1,
                  "async_checkpoint": mode == "async", "output_dir": str(out)}}))
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": args.gpu, "NCCL_NVLS_ENABLE": "0",
           "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1", "OMP_NUM_THREADS": "8"}
    began = time.perf_counter()
    log = work / f"run{index}-{mode}.log"
    with open(log, "w") as handle:
        code = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
                               "--master-addr=127.0.0.1", f"--master-port={quiet_port()}", "-m", "trainer",
                               "--config", str(recipe)], env=env, stdout=handle, stderr=subprocess.STDOUT,
                              timeout=args.timeout).returncode
    wall = time.perf_counter() - began
    if code:
        print("\n".join(log.read_text().splitlines()[-30:]), flush=True)
        shutil.rmtree(out, ignore_errors=True)
        return {"mode": mode, "exit": code}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = {r["step"]: r["time"] for r in records if "loss" in r and "time" in r}
    saves = [r for r in records if "checkpoint_s" in r]
    saved_at = {r["step"] for r in saves}
    gaps = {s: steps[s + 1] - steps[s] for s in steps if s + 1 in steps}
    plain = statistics.median(g for s, g in gaps.items() if s not in saved_at and s > 2)
    seen = [gaps[r["step"]] - plain for r in saves if r["step"] in gaps]
    replica = [f.stat().st_size for f in (out / "checkpoints").glob("ckpt-*/replica.pt")]
    shutil.rmtree(out, ignore_errors=True)
    return {"mode": mode, "exit": 0, "wall_s": round(wall, 1), "step_s": round(plain, 3),
            "stall_s": [r["checkpoint_s"] for r in saves], "write_s": [r.get("checkpoint_write_s") for r in saves],
            "stall_by_clock_s": [round(s, 2) for s in seen],
            "gb": round(saves[0]["checkpoint_bytes_node"] / 1e9, 2) if saves else None,
            "replica_gb": round(replica[0] / 1e9, 2) if replica else None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--r", type=int, default=192)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--order", default="sync,async,async,sync")
    parser.add_argument("--gpu", default="0")
    parser.add_argument("--timeout", type=float, default=400)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model = args.work / "llama8b"
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, str(REPO / "bench" / "common" / "make_llama.py"), str(model), "--hidden",
                        "4096", "--layers", "32", "--heads", "32", "--kv-heads", "8", "--intermediate", "14336",
                        "--no-weights", "--examples", "256", "--chars", str(args.seq * 2)], check=True)
    results = []
    for index, mode in enumerate(args.order.split(",")):
        result = one(mode, args, args.work, model, index)
        print(json.dumps(result), flush=True)
        results.append(result)
    by = {m: [r for r in results if r["mode"] == m and r["exit"] == 0] for m in ("sync", "async")}
    if by["sync"] and by["async"]:
        def median_of(mode, key):
            return statistics.median(v for r in by[mode] for v in r[key] if v is not None)
        sync_stall, async_stall = median_of("sync", "stall_s"), median_of("async", "stall_s")
        print(f"checkpoint of {by['sync'][0]['gb']} GB (rank file) + {by['sync'][0]['replica_gb']} GB (whole copy): "
              f"training waited {sync_stall:.2f} s written in place, {async_stall:.2f} s in the background "
              f"({sync_stall / max(async_stall, 1e-3):.1f}x less); by the clock {median_of('sync', 'stall_by_clock_s'):.2f} s "
              f"against {median_of('async', 'stall_by_clock_s'):.2f} s; the background write took "
              f"{median_of('async', 'write_s'):.2f} s; step {by['sync'][0]['step_s']:.2f} s / "
              f"{by['async'][0]['step_s']:.2f} s", flush=True)


if __name__ == "__main__":
    main()
