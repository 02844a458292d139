"""Trainer throughput side by side with the plain FSDP2 + LoRA script (bench/common/ref_plain_lora.py), in one run.

On the GPU machine (no sshd: local "nodes", each with its own GPUs):

    python3 bench/trainer/gpu_train.py --work /tmp/w --parts ref,2x1,2x2 --together --steps 50 --scale-steps 30

Builds an 8B-shaped random Llama (hidden 4096, 32 layers, 32/8 heads, FFN 14336, vocab 128256) unless --work
already has one, then runs what --parts names:
  ref   the reference, torchrun on GPUs 0,1, micro-batch --ref-batch with HF activation checkpointing
        (with --together, at the same time as 2x1 on GPUs 2,3);
  ref-noac  the reference without activation checkpointing (one flag; its fastest setting), micro-batch
        --ref-noac-batch (the largest that fits: 4 x 4096 tokens peaks at ~134 GB on an H200);
  2x1   `nodectl launch --nodes 2 --gpus 1` with the tuned recipe (same global batch: micro-batch x accumulation);
  2x2   `nodectl launch --nodes 2 --gpus 2`, the same recipe per GPU;
  1x1   `nodectl launch --nodes 1 --gpus 1`, the same recipe on one GPU;
  2x1-fsdp  2x1 with model.parallelism: fsdp (the base sharded, as before model.parallelism existed);
--parallelism sets model.parallelism for the nodectl runs (auto: the trainer picks and prints its choice).
and prints tokens/s per GPU (median over steps after --skip) twice: as the program reported it and from the wall
time between its records (they must agree within 2%), the ratio to the best reference, MFU, peak memory,
adapter save and checkpoint figures, the 2x2/2x1 scaling ratio and the step-by-step loss difference.
--tiny runs the same pipeline on a small model (CPU is fine) to check the bench itself.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMMON = REPO / "bench" / "common"   # the model makers and the reference script
SHAPE_8B = ["--hidden", "4096", "--layers", "32", "--heads", "32", "--kv-heads", "8", "--intermediate", "14336"]
SHAPE_70B = ["--hidden", "8192", "--layers", "80", "--heads", "64", "--kv-heads", "8", "--intermediate", "28672"]
SHAPE_TINY = ["--hidden", "64", "--layers", "4", "--heads", "4", "--kv-heads", "2", "--intermediate", "128",
              "--vocab", "512"]


def run(argv: list[str], cwd: Path, env: dict, log: Path, timeout: float) -> int:
    started = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.run(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode
    print(f"   {' '.join(argv[:6])} ... -> exit {code} in {time.perf_counter() - started:.0f}s (log {log})", flush=True)
    if code:
        print("   " + "\n   ".join(log.read_text().splitlines()[-25:]), flush=True)
    return code


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def nodectl_part(name: str, nodes: int, gpus: int, steps: int, args, work: Path, env: dict,
                 model: Path | None = None, **overrides) -> dict:
    project = work / f"project-{name}"
    project.mkdir(parents=True, exist_ok=True)
    model = model or work / "model"
    recipe = project / "recipe.yaml"
    micro = overrides.get("micro", args.micro)
    recipe.write_text(json.dumps({
        "model": {"path": str(model), "activation_checkpointing": overrides.get("ac", args.ac),
                  "compile": args.compile, "dtype": args.dtype,
                  "init": overrides.get("init", "random" if args.random_weights else "checkpoint"),
                  "reshard_after_forward": args.reshard,
                  "parallelism": overrides.get("parallelism", args.parallelism)},
        "lora": {"r": 16, "alpha": 32, "dropout": 0.0},
        "data": {"path": str(model / "train.jsonl"), "max_length": args.seq},
        "train": {"steps": steps, "micro_batch_size": micro,
                  "grad_accum": overrides.get("accum", args.ref_batch // args.micro),
                  "lr": args.lr, "warmup_steps": args.warmup, "log_every": 1, "weight_decay": 0.0,
                  "checkpoint_every": overrides.get("checkpoint_every", args.checkpoint_every),
                  "profile_at": overrides.get("profile_at", args.profile_at)},
    }))
    code = run([sys.executable, "-m", "nodectl", "launch", "--nodes", str(nodes), "--gpus", str(gpus),
                "--skip-preflight", "--config", str(recipe)], project, env, work / f"launch-{name}.log", args.timeout)
    runs = sorted(p for p in (project / "runs").iterdir() if not p.name.startswith(".")) if (project / "runs").is_dir() else []
    if not runs:
        return {"exit": code}
    run_dir = Path(env["HOME"]) / ".nodectl" / "local" / "runs" / runs[-1].name
    node0 = run_dir / "local0" / "output" if (run_dir / "local0").is_dir() else run_dir / "output"  # one node: no subfolder
    records = jsonl(node0 / "metrics.jsonl")
    summary = json.loads((node0 / "summary.json").read_text()) if (node0 / "summary.json").exists() else {}
    steps = [r for r in records if "loss" in r and "tokens_per_s_per_gpu" in r]
    events = [r for r in records if "checkpoint_s" in r]
    checkpoint_dir = next(iter(sorted((node0 / "checkpoints").glob("ckpt-*"))), None)
    adapter_bytes = sum(f.stat().st_size for f in (node0 / "adapter").glob("*")) if (node0 / "adapter").exists() else 0
    profile = node0 / "profile.txt"
    if profile.exists():
        print(f"   profile of {name}, steps {args.profile_at}-{args.profile_at + 1} (rank 0):\n"
              + "\n".join(profile.read_text().splitlines()[:32]), flush=True)
    return {"exit": code, "run": runs[-1].name, "steps": steps, "summary": summary,
            "checkpoint": events[0] if events else None, "adapter_bytes": adapter_bytes,
            "checkpoint_files": sorted(f.name for f in checkpoint_dir.iterdir()) if checkpoint_dir else []}


def seventy(args, work: Path, env: dict) -> dict:
    """The 70B-shaped Llama (hidden 8192, 80 layers, 64/8 heads, FFN 28672) on 2 "nodes" x 1 GPU from random
    shards (model.init: random: no 140 GB checkpoint), LoRA r=16, every layer checkpointed, micro-batch
    --micro-70b, accumulation --accum-70b."""
    model = work / "model-70b"
    if not (model / "config.json").exists():
        shape = SHAPE_TINY if args.tiny else SHAPE_70B
        code = run([sys.executable, str(COMMON / "make_llama.py"), str(model), *shape, "--no-weights",
                    "--examples", str(args.examples), "--chars", str(args.seq + 4)], work, env, work / "make70.log",
                   args.timeout)
        if code:
            return {"exit": code}
    return nodectl_part("70b", 2, 1, args.steps_70b, args, work, env, model=model, init="random", ac=True,
                        micro=args.micro_70b, accum=args.accum_70b, checkpoint_every=0, profile_at=0)


def median_after(steps: list[dict], skip: int, key: str) -> float | None:
    values = [s[key] for s in steps if s["step"] > skip and s.get(key) is not None]
    return statistics.median(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--parts", default="ref,2x1,2x2")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--scale-steps", type=int, default=0, help="steps of the 2x2 run (default: --steps)")
    parser.add_argument("--skip", type=int, default=5, help="steps left out of the medians (compilation, warm-up)")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--ref-batch", type=int, default=4)
    parser.add_argument("--ref-noac-batch", type=int, default=4)
    parser.add_argument("--micro", type=int, default=4, help="nodectl's micro-batch; accumulation makes up --ref-batch")
    parser.add_argument("--ac", default="false")
    parser.add_argument("--compile", default="true")
    parser.add_argument("--dtype", default="auto", help="model.dtype of the nodectl runs (auto: bf16 on GPUs)")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--checkpoint-every", type=int, default=25)
    parser.add_argument("--examples", type=int, default=400)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--together", action="store_true", help="reference and 2x1 at once on GPUs 0,1 and 2,3")
    parser.add_argument("--profile-at", type=int, default=0, help="train.profile_at for the nodectl runs")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--reshard", default="true", help="model.reshard_after_forward of the nodectl runs")
    parser.add_argument("--parallelism", default="auto", help="model.parallelism of the nodectl runs")
    parser.add_argument("--steps-70b", type=int, default=8)
    parser.add_argument("--random-weights", action="store_true",
                        help="write no 16 GB checkpoint: the reference builds the model with transformers' own "
                             "initialisation on the GPU (--random-init), the nodectl runs with model.init: random")
    parser.add_argument("--micro-70b", type=int, default=2)
    parser.add_argument("--accum-70b", type=int, default=1)
    args = parser.parse_args()
    args.ac = args.ac.lower() == "true" if args.ac.lower() in ("true", "false") else float(args.ac)
    args.compile = args.compile.lower() == "true"
    args.reshard = args.reshard.lower() == "true"
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    parts = args.parts.split(",")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1", "HOME": os.environ.get("HOME", str(work))}
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}}

    model = work / "model"
    if not (model / "config.json").exists():
        shape = SHAPE_TINY if args.tiny else SHAPE_8B
        started = time.perf_counter()
        code = run([sys.executable, str(COMMON / "make_llama.py"), str(model), *shape,
                    *(["--no-weights"] if args.random_weights else []),
                    "--examples", str(args.examples), "--chars", str(args.seq + 4)], work, env, work / "make.log",
                   args.timeout)
        if code:
            sys.exit(code)
        results["model_written_s"] = round(time.perf_counter() - started, 1)
        print((work / "make.log").read_text().strip().splitlines()[-1], flush=True)

    def reference(name: str = "ref", batch: int = args.ref_batch, flags: tuple = ()) -> None:
        code = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29611",
                    str(COMMON / "ref_plain_lora.py"), "--model", str(model), "--data",
                    str(model / "train.jsonl"), "--seq", str(args.seq), "--batch", str(batch),
                    "--steps", str(args.steps), "--lr", str(args.lr), "--warmup", str(args.warmup),
                    "--out", str(work / f"{name}.jsonl"), *flags,
                    *(["--random-init"] if args.random_weights else [])], work, {**env, "CUDA_VISIBLE_DEVICES": "0,1"},
                   work / f"{name}.log", args.timeout)
        results[name] = {"exit": code, "steps": jsonl(work / f"{name}.jsonl"), "world": 2}

    if "ref-noac" in parts:
        reference("ref-noac", args.ref_noac_batch, ("--no-checkpointing",))

    def two_by_one() -> None:
        gpus = {"CUDA_VISIBLE_DEVICES": "2,3"} if args.together else {}
        results["2x1"] = dict(nodectl_part("2x1", 2, 1, args.steps, args, work, {**env, **gpus}), world=2)

    # --together: the reference on GPUs 0,1 and nodectl's 2 x 1 on GPUs 2,3 at the same time (4 GPUs)
    jobs = [job for part, job in (("ref", reference), ("2x1", two_by_one)) if part in parts]
    if args.together:
        threads = [threading.Thread(target=job) for job in jobs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    else:
        for job in jobs:
            job()
    if args.compile and results.get("2x1", {}).get("exit"):  # say what compilation broke, then measure eager
        print("   2x1 failed with model.compile=true; once more with compile=false", flush=True)
        args.compile = False
        results["2x1-compiled-failed"] = results.pop("2x1")
        results["2x1"] = dict(nodectl_part("2x1-eager", 2, 1, args.steps, args, work, env), world=2)
    if "1x1" in parts:   # one GPU through nodectl launch (the dense no-regression figure)
        results["1x1"] = dict(nodectl_part("1x1", 1, 1, args.steps, args, work, env), world=1)
    if "2x1-fsdp" in parts:   # the same as 2x1 with the base sharded (the layout before model.parallelism)
        results["2x1-fsdp"] = dict(nodectl_part("2x1-fsdp", 2, 1, args.steps, args, work, env,
                                                parallelism="fsdp"), world=2)
    if "70b" in parts:
        results["70b"] = dict(seventy(args, work, env), world=2)
    if "2x2" in parts:
        results["2x2"] = dict(nodectl_part("2x2", 2, 2, args.scale_steps or args.steps, args, work, env), world=4)

    report(results, args)
    out = args.out or work / "gpu_train.json"
    out.write_text(json.dumps(results, indent=1))
    print(f"figures: {out}")


def by_gaps(steps: list[dict], skip: int, world: int) -> float | None:
    """tokens/s per GPU from the wall time between consecutive records (what a user's clock sees)."""
    rates = [after["real_tokens"] / (after["time"] - before["time"]) / world
             for before, after in zip(steps, steps[1:])
             if after["step"] > skip and after["step"] == before["step"] + 1 and "real_tokens" in after]
    return statistics.median(rates) if rates else None


def report(results: dict, args) -> None:
    print(f"\n== tokens/s per GPU, median over the steps after step {args.skip}; seq {args.seq}")
    print("   reported: the program's own figure; by gaps: real tokens / wall time between its records")
    refs = {part: by_gaps(results[part].get("steps", []), args.skip, results[part].get("world", 2))
            for part in ("ref", "ref-noac") if part in results}
    best = max((v for v in refs.values() if v), default=None)
    ours = results.get("2x1", {}).get("steps", [])
    mfu_ours = median_after(ours, args.skip, "mfu")
    causal_ours = median_after(ours, args.skip, "mfu_causal")
    tps_ours = by_gaps(ours, args.skip, 2)
    for part in ("ref", "ref-noac", "1x1", "2x1", "2x1-fsdp", "2x2", "70b"):
        if part not in results:
            continue
        steps = results[part].get("steps", [])
        reported = median_after(steps, args.skip, "tokens_per_s_per_gpu")
        gaps = by_gaps(steps, args.skip, results[part].get("world", 2))
        agree = f"{reported / gaps:.3f}" if reported and gaps else "-"
        mfu = median_after(steps, args.skip, "mfu")
        causal = median_after(steps, args.skip, "mfu_causal")
        if mfu is None and gaps and tps_ours and mfu_ours and part.startswith("ref"):  # 2x1's model and FLOPs
            mfu, causal = mfu_ours * gaps / tps_ours, (causal_ours or 0) * gaps / tps_ours
        memory = max((s.get("max_memory_gb") or 0 for s in steps), default=0)
        ratio = f"{gaps / best:.3f}x best ref" if gaps and best and part != "70b" else ""
        print(f"   {part:8} exit {results[part].get('exit')}  reported {reported or 0:>7.0f}  by gaps {gaps or 0:>7.0f} "
              f"(agree {agree})  {ratio:16} MFU {100 * (mfu or 0):.1f}% (causal {100 * (causal or 0):.1f}%)  "
              f"peak {memory:.1f} GB")
    if "2x1" in results and "2x2" in results:
        one = by_gaps(results["2x1"].get("steps", []), args.skip, 2)
        two = by_gaps(results["2x2"].get("steps", []), args.skip, 4)
        if one and two:
            print(f"   scaling 2x2 / 2x1 per GPU (by gaps): {two / one:.3f}")
    for part in ("2x1", "2x2"):
        if part in results and results[part].get("summary"):
            adapter = results[part]["summary"].get("adapter", {})
            print(f"   {part} adapter save {adapter.get('seconds', 0):.2f}s (gather {adapter.get('gather_seconds', 0):.2f}s), "
                  f"{adapter.get('gathered_bytes', 0) / 2**20:.0f} MiB gathered, "
                  f"{results[part]['adapter_bytes'] / 2**20:.0f} MiB on disk; checkpoint {results[part]['checkpoint']}")
    ref = {s["step"]: s["loss"] for s in results.get("ref", {}).get("steps", [])}
    ours = {s["step"]: s["loss"] for s in results.get("2x1", {}).get("steps", [])}
    common = sorted(set(ref) & set(ours))
    if common:
        diffs = [abs(ref[s] - ours[s]) for s in common]
        print(f"\n== loss, reference vs 2x1 over {len(common)} steps: max |diff| {max(diffs):.4f}, "
              f"mean |diff| {statistics.mean(diffs):.4f}; first {ref[common[0]]:.4f} / {ours[common[0]]:.4f}, "
              f"last {ref[common[-1]]:.4f} / {ours[common[-1]]:.4f}")
        for s in common[:: max(1, len(common) // 10)]:
            print(f"   step {s:>3}  ref {ref[s]:.4f}  nodectl {ours[s]:.4f}")


if __name__ == "__main__":
    main()
