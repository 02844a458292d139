"""Loading a checkpoint into FSDP2 shards: each rank reading its own slices (model.load: sliced) against rank 0
reading every weight and broadcasting (model.load: broadcast, what the trainer did before), side by side in one
run, on CPU ranks with gloo. Prints each rank's owned host memory (RssAnon) before loading and its peak while
loading (sampled every 5 ms), the RSS peak including mapped file pages (page cache), and the load time.

    python bench/trainer/load.py --ranks 2 --layers 8 --hidden 2048 [--checkpoint-dtype float32]

The model is a random Llama written as safetensors shards (about 1 GB of bf16 at the defaults) in a temporary
folder; it trains in bf16, so a float32 checkpoint is converted while loading.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def rss_mib(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


class PeakAnon:
    """The peak of RssAnon (memory the process owns; file pages a memory map reads are page cache, which
    the kernel can drop) sampled every 5 ms while loading."""

    def __init__(self) -> None:
        import threading

        self.peak, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mib("RssAnon"))
            self._stop.wait(0.005)

    def __enter__(self) -> "PeakAnon":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_mib("RssAnon"))


def worker(model_dir: str, mode: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, str(REPO))
    from trainer.config import Recipe, ModelConfig
    from trainer.model import build_skeleton, materialise, materialise_sliced, parallelize

    recipe = Recipe(model=ModelConfig(path=model_dir, activation_checkpointing=False))
    path = Path(model_dir)
    model = build_skeleton(recipe, path, torch.bfloat16)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    parallelize(model, recipe, init_device_mesh("cpu", (world,)), False)   # wraps the model in place
    before, before_anon = rss_mib(), rss_mib("RssAnon")
    dist.barrier()
    started = time.perf_counter()
    with PeakAnon() as anon:
        if mode == "sliced":
            materialise_sliced(model, path, torch.device("cpu"), 0)
        else:
            materialise(model, path, torch.device("cpu"), rank, 0)
        dist.barrier()
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    checksum = torch.tensor([float(sum(p.to_local().float().sum() for p in model.parameters()))])
    dist.all_reduce(checksum)
    sys.stdout.write("\nLOAD " + json.dumps({"mode": mode, "rank": rank, "rss_before_mib": round(before),
                                "peak_mib": round(peak), "anon_before_mib": round(before_anon),
                                "anon_peak_mib": round(anon.peak), "seconds": round(seconds, 2),
                                "checksum": checksum.item()}) + "\n")
    sys.stdout.flush()
    dist.barrier()
    os._exit(0)  # gloo's threads abort some ranks at interpreter teardown (see trainer/__main__.py)


def make_model(folder: Path, layers: int, hidden: int, dtype: str) -> float:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=int(hidden * 2.6875),
                         num_hidden_layers=layers, num_attention_heads=hidden // 128, num_key_value_heads=8,
                         max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="300MB")
    from transformers import AutoTokenizer  # noqa: F401  (a tokenizer is not needed to load weights)
    return sum(p.numel() for p in model.parameters()) * 2 / 2**30   # as trained: bf16


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--checkpoint-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="the weights on disk; the model trains in bf16 either way")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each mode, interleaved")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL_DIR", "MODE"))
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    root = Path(tempfile.mkdtemp(prefix="nodectl-load-"))
    try:
        size = make_model(root / "model", args.layers, args.hidden, args.checkpoint_dtype)
        print(f"model: {size:.2f} GiB in bf16, on disk as {args.checkpoint_dtype} in "
              f"{len(list((root / 'model').glob('*.safetensors')))} shards; {args.ranks} CPU ranks (gloo)")
        results = {}
        for mode in ("sliced", "broadcast") * args.rounds:  # interleaved: the page cache is as warm for both
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.ranks}",
                                   "--master-addr=127.0.0.1", f"--master-port={free_port()}", __file__, "--worker",
                                   str(root / "model"), mode], capture_output=True, text=True, env=env, timeout=1200)
            if proc.returncode:
                raise SystemExit(proc.stdout[-2000:] + proc.stderr[-3000:])
            decoder = json.JSONDecoder()  # ranks share one pipe: read each "LOAD {...}" wherever it landed
            rows = [decoder.raw_decode(part)[0] for part in proc.stdout.split("LOAD ")[1:]]
            results[mode] = sorted(rows, key=lambda r: r["rank"])
            for row in results[mode]:
                print(f"   {mode:9} rank {row['rank']}: owned memory {row['anon_before_mib']:6} MiB before, peak "
                      f"{row['anon_peak_mib']:6} MiB (+{row['anon_peak_mib'] - row['anon_before_mib']}); RSS with "
                      f"mapped file pages +{row['peak_mib'] - row['rss_before_mib']} MiB; {row['seconds']:.2f}s, "
                      f"checksum {row['checksum']:.6g}", flush=True)
        sliced, broadcast = results["sliced"][0], results["broadcast"][0]
        print(f"\nrank 0 owned-memory peak over its pre-load level: sliced "
              f"+{sliced['anon_peak_mib'] - sliced['anon_before_mib']} MiB, broadcast "
              f"+{broadcast['anon_peak_mib'] - broadcast['anon_before_mib']} MiB (model {size * 1024:.0f} MiB, "
              f"its shard {size * 1024 / args.ranks:.0f} MiB); "
              f"load time sliced {sliced['seconds']:.2f}s vs broadcast {broadcast['seconds']:.2f}s "
              f"({broadcast['seconds'] / sliced['seconds']:.2f}x); same weights: "
              f"{sliced['checksum'] == broadcast['checksum']}")
        print("RESULT " + json.dumps({"model_mib": size * 1024, "ranks": args.ranks,
                                      "sliced_growth_mib": sliced["anon_peak_mib"] - sliced["anon_before_mib"],
                                      "broadcast_growth_mib": broadcast["anon_peak_mib"] - broadcast["anon_before_mib"],
                                      "same_weights": sliced["checksum"] == broadcast["checksum"]}))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
