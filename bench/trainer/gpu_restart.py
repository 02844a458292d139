"""What a run loses to start-up, checkpoints and a crash, through `nodectl launch` as a user runs it (issue 67's
measurement): before (checkpoints written while training waits, no compile cache: `train.async_checkpoint: false`,
`train.compile_cache: false`, the trainer before 28877b6) and after (the defaults), in one call.

    python3 bench/trainer/gpu_restart.py --work /tmp/rs [--shape qwen3-30b-a3b] [--layers 0] [--modes before,after]
        [--steps 14] [--every 5] [--kill-at 12] [--ac 0.1] [--dropout 0.0 --targets q_proj,k_proj,v_proj,o_proj]
        [--timeout 400] [--tiny]

One GPU, one local "node": `nodectl launch --nodes 1 --gpus 1 --max-restarts 1 --skip-preflight` of the built-in
trainer on a random-weight model of the shape (FP8 experts, compile, rows of --seq tokens), a checkpoint every
--every steps; once rank 0 has logged step --kill-at and the checkpoint before it is complete, the bench SIGKILLs it,
and nodectl restarts the run from that checkpoint. Each mode gets compiler caches of its own (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR), empty at
its launch and kept across its attempts, as a node's /tmp keeps them. Every output line is timestamped. Figures per
mode: launch to the first step's record; each checkpoint's stall (`checkpoint_s`: what training waited, and by the
clock: the gap around the checkpoint step less the median gap); the kill to the first record of the new attempt;
the trainer's own lines on weights and the compile cache.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMMON = REPO / "bench" / "common"
MODES = {"before": ["train.async_checkpoint=false", "train.compile_cache=false"], "after": []}


def rank0_pid(node_run: Path) -> int | None:
    """The built-in trainer's rank 0 (the program, not its wrapper): the pid its wrapper recorded."""
    try:
        return int((node_run / "ranks" / "rank0.pid").read_text())
    except (OSError, ValueError):
        return None


def records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def one(mode: str, args, model: Path, work: Path, env: dict) -> dict:
    project = work / f"project-{mode}"
    project.mkdir(parents=True, exist_ok=True)
    caches = work / f"caches-{mode}"
    env = {**env, "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"), "TRITON_CACHE_DIR": str(caches / "triton")}
    sets = [f"model.path={model}", "model.init=random", f"model.compile={str(not args.tiny).lower()}",
            f"model.fp8_experts={str(not args.tiny and not args.dropout).lower()}",
            f"model.activation_checkpointing={args.ac}", f"data.path={model / 'train.jsonl'}",
            f"data.max_length={args.seq}", "lora.r=16", "lora.alpha=32", f"lora.dropout={args.dropout}",
            f"lora.target_modules=[{args.targets}]", *(["lora.target_parameters=[none]"] if args.dropout else []),
            f"train.steps={args.steps}", "train.log_every=1", "train.warmup_steps=2", "train.lr=2e-4",
            f"train.micro_batch_size={args.micro}", f"train.checkpoint_every={args.every}",
            "train.checkpoint_minutes=0", "train.keep_checkpoints=1", *MODES[mode]]
    argv = [sys.executable, "-m", "nodectl", "launch", "--nodes", "1", "--gpus", "1", "--max-restarts", "1",
            "--skip-preflight"] + [w for s in sets for w in ("--set", s)]
    log = open(work / f"{mode}.log", "w")
    began = time.time()
    proc = subprocess.Popen(argv, cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        for line in proc.stdout:
            now = time.time()
            lines.append((now, line.rstrip()))
            log.write(f"{now - began:8.2f} {line}")
            log.flush()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    run_id, metrics, killed = None, None, None
    deadline = began + args.timeout
    while proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
        if metrics is None:
            runs = sorted(p.name for p in (project / "runs").iterdir() if p.name[0].isdigit()) \
                if (project / "runs").is_dir() else []
            if runs:
                run_id = runs[-1]
                node = Path.home() / ".nodectl" / "local" / "runs" / run_id
                metrics = next(iter(node.glob("**/output/metrics.jsonl")), None)
            continue
        # the kill comes once step --kill-at is logged and the checkpoint before it is complete (a background
        # write still going would be lost with the rank, and the new attempt would start further back)
        complete = [int(c.parent.name.split("-")[-1]) for c in (metrics.parent / "checkpoints").glob("ckpt-*/COMPLETE")]
        if killed is None and max(complete, default=-1) >= args.kill_at // args.every * args.every \
                and any(r.get("step", 0) >= args.kill_at and "loss" in r for r in records(metrics)):
            pid = rank0_pid(metrics.parent.parent)
            if pid:
                os.kill(pid, signal.SIGKILL)
                killed = time.time()
                log.write(f"{killed - began:8.2f} [bench] SIGKILL rank 0 (pid {pid})\n")
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    reader.join(timeout=5)
    log.close()
    node = Path.home() / ".nodectl" / "local" / "runs" / (run_id or "none")
    if metrics is None:
        metrics = next(iter(node.glob("**/output/metrics.jsonl")), Path("/nonexistent"))
    found = records(metrics)
    steps = [r for r in found if "loss" in r and "time" in r]
    saves = [r for r in found if "checkpoint_s" in r]
    first = steps[0]["time"] if steps else None
    after_kill = [r for r in steps if killed and r["time"] > killed]
    gaps = {b["step"]: b["time"] - a["time"] for a, b in zip(steps, steps[1:]) if b["step"] == a["step"] + 1}
    saved_at = {r["step"] for r in saves}
    plain = statistics.median([g for s, g in gaps.items() if s - 1 not in saved_at and s > 3] or [0])
    before_kill = {r["step"]: r["loss"] for r in steps if killed and r["time"] <= killed}
    redone = [(r["step"], before_kill[r["step"]], r["loss"]) for r in after_kill if r["step"] in before_kill]
    said = [text for _, text in lines if "compile cache" in text or "weights loaded" in text or "resuming" in text
            or "restart" in text.lower() or "attempt" in text]
    return {"mode": mode, "exit": proc.returncode, "wall_s": round(time.time() - began, 1),
            "launch_to_first_step_s": round(first - began, 1) if first else None,
            "checkpoint_stall_s": [r["checkpoint_s"] for r in saves],
            "checkpoint_stall_by_clock_s": [round(gaps[s + 1] - plain, 2) for s in sorted(saved_at) if s + 1 in gaps],
            "checkpoint_gb": round(saves[0].get("checkpoint_bytes_node", 0) / 1e9, 2) if saves else None,
            "step_s": round(plain, 3), "killed_at_s": round(killed - began, 1) if killed else None,
            "kill_to_first_new_step_s": round(after_kill[0]["time"] - killed, 1) if after_kill else None,
            "resumed_at_step": after_kill[0]["step"] if after_kill else None,
            # the steps done again: (step, loss before the kill, loss in the new attempt); resume is exact, so a
            # difference beyond the kernels' nondeterminism is a fault (a kept graph replaying other random numbers)
            "redone_losses": redone,
            "redone_loss_max_diff": round(max((abs(a - b) for _, a, b in redone), default=0.0), 5),
            "said": said[:20]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=0, help="only this many of the shape's layers")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro", type=int, default=1)
    parser.add_argument("--ac", default="0.1", help="model.activation_checkpointing")
    parser.add_argument("--dropout", type=float, default=0.0, help="lora.dropout: above 0, the checkpointed layers "
                        "replay random numbers in backward, and the new attempt's losses show whether they match (peft "
                        "has no dropout on fused experts: their weights are then left without adapters, and bf16; give --targets "
                        "q_proj,k_proj,v_proj,o_proj with it)")
    parser.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                        help="lora.target_modules")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--kill-at", type=int, default=12)
    parser.add_argument("--modes", default="before,after")
    parser.add_argument("--timeout", type=float, default=400, help="seconds per mode")
    parser.add_argument("--tiny", action="store_true", help="a small model of the layout, no compile, no FP8: the "
                        "bench's own check on a CPU")
    args = parser.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    model = work / ("model-tiny" if args.tiny else f"model-{args.shape}" + (f"-{args.layers}l" if args.layers else ""))
    if not (model / "config.json").exists():
        shape = ["--layout", "qwen3_moe", "--hidden", "64", "--layers", "2", "--experts", "8", "--top-k", "2",
                 "--expert-intermediate", "32", "--heads", "4"] if args.tiny \
            else ["--shape", args.shape, "--shape-layers", str(args.layers)]
        subprocess.run([sys.executable, str(COMMON / "make_moe.py"), str(model), *shape, "--no-weights", "--examples",
                        "200", "--chars", str(args.seq + 4)], env=env, check=True, stdout=subprocess.DEVNULL)
    results = []
    for mode in args.modes.split(","):
        result = one(mode, args, model, work, env)
        print(json.dumps(result), flush=True)
        results.append(result)
    by = {r["mode"]: r for r in results}
    if "before" in by and "after" in by:
        for key in ("launch_to_first_step_s", "kill_to_first_new_step_s"):
            b, a = by["before"][key], by["after"][key]
            if a and b:
                print(f"{key}: before {b} s, after {a} s ({b / a:.2f}x)", flush=True)
        b, a = by["before"]["checkpoint_stall_s"], by["after"]["checkpoint_stall_s"]
        if a and b:
            print(f"checkpoint stall ({by['before']['checkpoint_gb']} GB per node): before {b} s, after {a} s "
                  f"(median {statistics.median(b) / max(statistics.median(a), 1e-3):.1f}x less)", flush=True)


if __name__ == "__main__":
    main()
