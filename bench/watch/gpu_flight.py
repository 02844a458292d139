"""What the flight recorder and the diagnose listener cost the built-in trainer: the same run with nodectl's
settings (TORCH_FR_BUFFER_SIZE=2000, the listener in every rank) and with the recorder off (buffer 0), interleaved
on, off, on, off in one command so drift hits both alike.

    python3 bench/watch/gpu_flight.py --work /tmp/fr [--steps 40 --skip 10 --rounds 2]

One local node with one GPU (the 1B-shaped Llama of bench/trainer/gpu_proof.sh: hidden 2048, 16 layers, 32/8 heads, FFN
8192, vocab 128256; seq 2048, micro-batch 4, no activation checkpointing, compiled). Prints tokens/s per GPU, as
the trainer reported it and from the wall time between its records, per run and the on/off ratio.
--tiny checks the bench itself on a small model (CPU is fine).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from gpu_train import COMMON, REPO, by_gaps, median_after, nodectl_part, run  # noqa: E402

SHAPE_1B = ["--hidden", "2048", "--layers", "16", "--heads", "32", "--kv-heads", "8", "--intermediate", "8192"]
SHAPE_TINY = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--intermediate", "128",
              "--vocab", "512"]
RECORDER_OFF = {"TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1", "PYTHONPATH": str(REPO)}
    env.setdefault("HOME", str(Path.home()))
    model = work / "model"
    if not (model / "config.json").exists():
        shape = SHAPE_TINY if args.tiny else SHAPE_1B
        if run([sys.executable, str(COMMON / "make_llama.py"), str(model), *shape, "--examples", "300",
                "--chars", str(args.seq + 4)], work, env, work / "make.log", args.timeout):
            raise SystemExit("could not build the model")
    settings = argparse.Namespace(micro=args.micro, ac="false", compile="false" if args.tiny else "true",
                                  dtype="auto", reshard="true", ref_batch=args.micro, lr=2e-4, warmup=3,
                                  checkpoint_every=0, profile_at=0, seq=args.seq, timeout=args.timeout)
    results: dict[str, list] = {"on": [], "off": []}
    for round_ in range(args.rounds):
        for mode in ("on", "off"):
            name = f"{mode}{round_}"
            project = work / f"project-{name}"
            project.mkdir(parents=True, exist_ok=True)
            node = {"name": "local0", "host": "localhost", "transport": "local", "gpus": 1,
                    "python": sys.executable, **({"device": "cpu"} if args.tiny else {})}
            if mode == "off":
                node["env"] = RECORDER_OFF
            (project / "hosts.yaml").write_text(json.dumps({"nodes": [node]}))
            part = nodectl_part(name, 1, 1, args.steps, settings, work, env, model=model)
            steps = part.get("steps") or []
            reported = median_after(steps, args.skip, "tokens_per_s_per_gpu")
            gaps = by_gaps(steps, args.skip, 1)
            results[mode].append({"run": name, "exit": part.get("exit"), "reported": reported, "by_gaps": gaps})
            print(f"{name:5} exit {part.get('exit')}  tokens/s per GPU: reported "
                  f"{reported or 0:,.0f}, from the wall clock between records {gaps or 0:,.0f}", flush=True)
    on = [r["by_gaps"] for r in results["on"] if r["by_gaps"]]
    off = [r["by_gaps"] for r in results["off"] if r["by_gaps"]]
    if on and off:
        ratio = statistics.median(on) / statistics.median(off)
        print(f"recorder on / off (median of {len(on)} and {len(off)} runs, wall clock): {ratio:.3f}")
        results["ratio_on_off"] = ratio
    (work / "gpu_flight.json").write_text(json.dumps(results, indent=1))
    print(f"figures: {work / 'gpu_flight.json'}")


if __name__ == "__main__":
    main()
