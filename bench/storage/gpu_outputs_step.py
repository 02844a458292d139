"""Training step time with the node's uploads running (outputs:) against without, in one run, on one GPU.

    python3 bench/storage/gpu_outputs_step.py --work /tmp/w --steps 40 --repeats 2

Builds the 8B-shaped random Llama of bench/trainer/gpu_train.py (no weights written: model.init random) unless --work has
it, starts an S3 server on this machine (moto's, tests/support/s3server.py), then alternates two `nodectl launch` runs of
the built-in trainer on one local node and GPU (LoRA r 16, micro-batch --micro x 4096 tokens, a full checkpoint
every --checkpoint-every steps: LoRA weights, Adam state and the replica, about 1 GB for this model):
  without   no outputs:
  with      outputs: every --every seconds to the server: each checkpoint is uploaded while the next steps run
Per run: the median step time from the wall clock between the trainer's step records (steps after --skip, the
checkpoint steps left out: their save is the same on both sides) and from the trainer's own step_time_s, the
run's wall time, and for `with` what reached the bucket. Printed: the ratio with/without (goal: within 2%).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMMON = REPO / "bench" / "common"   # the model makers and the reference script
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench" / "trainer"))
from support.s3server import s3_server  # noqa: E402
from gpu_train import SHAPE_8B, SHAPE_TINY, jsonl  # noqa: E402

BUCKET = "step-bench"


def one_run(name: str, args, work: Path, env: dict, server) -> dict:
    project = work / f"project-{name}-{time.time_ns()}"
    project.mkdir(parents=True)
    model = work / "model"
    (project / "recipe.yaml").write_text(json.dumps({
        "model": {"path": str(model), "init": "random", "activation_checkpointing": args.ac, "compile": False},
        "lora": {"r": 16, "alpha": 32, "dropout": 0.0},
        "data": {"path": str(model / "train.jsonl"), "max_length": args.seq},
        "train": {"steps": args.steps, "micro_batch_size": args.micro, "grad_accum": 1, "log_every": 1,
                  "checkpoint_every": args.checkpoint_every, "checkpoint_minutes": 0, "keep_checkpoints": 2}}))
    device = "cpu" if args.tiny else "cuda"
    hosts = {"nodes": [{"host": "localhost", "name": "local0", "transport": "local", "gpus": 1, "device": device,
                        "python": sys.executable, "env": server.env if name == "with" else {}}]}
    if name == "with":
        hosts["outputs"] = {"url": f"s3://{BUCKET}/{name}", "every": args.every, "endpoint_url": server.endpoint}
    (project / "hosts.yaml").write_text(json.dumps(hosts))
    started = time.perf_counter()
    log = work / f"launch-{project.name}.log"
    with open(log, "w") as out:
        code = subprocess.run([sys.executable, "-m", "nodectl", "-i", "hosts.yaml", "launch", "--skip-preflight",
                               "--config", "recipe.yaml"], cwd=project, env=env, stdout=out,
                              stderr=subprocess.STDOUT, timeout=args.timeout).returncode
    wall = time.perf_counter() - started
    if code:
        print(log.read_text()[-3000:], flush=True)
        raise SystemExit(f"{name}: launch exited {code}")
    run_id = sorted(p.name for p in (project / "runs").iterdir() if p.name[0].isdigit())[-1]
    run_dir = Path(env["HOME"]) / ".nodectl" / "local" / "runs" / run_id
    records = jsonl(run_dir / "output" / "metrics.jsonl")
    steps = [r for r in records if "loss" in r and "time" in r]
    saves = {r["step"] for r in records if "checkpoint_s" in r}
    gaps = [b["time"] - a["time"] for a, b in zip(steps, steps[1:])
            if b["step"] == a["step"] + 1 and a["step"] > args.skip and a["step"] not in saves]
    own = [r["step_time_s"] for r in steps if r["step"] > args.skip and r["step"] - 1 not in saves
           and r["step"] not in saves]
    result = {"name": name, "wall_s": wall, "step_wall_s": statistics.median(gaps), "step_own_s": statistics.median(own),
              "steps_timed": len(gaps), "saves": sorted(saves)}
    if name == "with":
        if not (run_dir / "state" / "upload.json").exists():
            raise SystemExit(f"the uploader wrote no state: {(run_dir / 'logs' / 'upload.log').read_text()[-2000:]}")
        upload = json.loads((run_dir / "state" / "upload.json").read_text())
        stored = server.objects(BUCKET, f"{name}/{run_id}/")
        result.update(rounds=upload["rounds"], sent_mb=upload["bytes"] / 2**20, stored_files=len(stored),
                      upload_error=upload["error"])
        for key in stored:
            server.client().delete_object(Bucket=BUCKET, Key=key)
    print(f"  {name:8s} step {result['step_wall_s'] * 1000:7.1f} ms by the wall clock ({result['step_own_s'] * 1000:7.1f}"
          f" ms by the trainer), run {wall:6.1f} s" + (f", {result['rounds']} upload rounds, {result['sent_mb']:.0f} MiB"
                                                         f" sent, {result['stored_files']} objects, error: "
                                                         f"{result['upload_error']}" if name == "with" else ""),
          flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=3)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--ac", default=True)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--every", default="5s")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--tiny", action="store_true", help="a small model (CPU is fine): checks the bench itself")
    args = parser.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1", "HOME": os.environ.get("HOME", str(work))}
    if not (work / "model" / "config.json").exists():
        subprocess.run([sys.executable, str(COMMON / "make_llama.py"), str(work / "model"),
                        *(SHAPE_TINY if args.tiny else SHAPE_8B), "--no-weights", "--examples", "200", "--chars",
                        str(args.seq + 4)], check=True, env=env, cwd=work, stdout=subprocess.DEVNULL)
    with s3_server(work / "moto.log") as server:
        server.bucket(BUCKET)
        results = {"without": [], "with": []}
        for repeat in range(args.repeats):
            print(f"repeat {repeat + 1}", flush=True)
            for name in ("without", "with"):
                results[name].append(one_run(name, args, work, env, server))
    without = statistics.median(r["step_wall_s"] for r in results["without"])
    with_ = statistics.median(r["step_wall_s"] for r in results["with"])
    walls = [statistics.median(r["wall_s"] for r in results[n]) for n in ("without", "with")]
    print(f"\nmedian step time: without {without * 1000:.1f} ms, with uploads {with_ * 1000:.1f} ms: "
          f"{with_ / without:.3f}x (goal: within 2%); run wall time {walls[0]:.1f} s vs {walls[1]:.1f} s")
    (work / "outputs_step.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
