"""A model of step time on paper, per layout, for a cluster the bench machines are not (issue 39: seed 003's two
nodes of 8 H200 joined by 100 Gb/s TCP). CPU only; nothing runs on a GPU.

    python bench/moe/step_model.py --shape glm-4.5-air --nodes 2 --gpus 8 --micro 1 --checkpointed 1.0 \\
        --compute-s 1.96 --nvlink-gbs 350 --network-gbs 12.5

The model's skeleton is built on the meta device from the shape's published dimensions (bench/common/make_moe.py) with
the trainer's own LoRA recipe, and trainer/layout.py gives, for each layout, the estimated peak memory per GPU and
the bytes one GPU sends per step of one micro-batch, inside the node and across nodes (the same figures the
trainer's `traffic` record checks against the counted collectives; on 4 H200s they agreed within 1%). Step time:
  compute   --compute-s, the measured seconds of one such step where communication is overlapped on NVLink
            (GLM-4.5-Air, 1 node x 4 H200, micro-batch 1, every layer checkpointed: 1.96-1.98 s);
  NVLink    bytes inside the node / --nvlink-gbs (NCCL's bus bandwidth: 350 GB/s measured on 4 H200s);
  network   bytes across nodes from the whole node (GPUs per node x the per-GPU average) / --network-gbs
            (100 Gb/s = 12.5 GB/s each way at best; TCP gets less);
and the step lies between max(compute, NVLink, network) (all overlapped) and their sum (nothing overlapped).

With --auto-rows R it prints instead what `train.micro_batch_size: auto` and `model.activation_checkpointing: auto`
would choose for R rows per rank and step on that cluster (trainer/layout.py plan: the line rank 0 prints), and
every split's memory and time estimate:

    python bench/moe/step_model.py --shape qwen3-30b-a3b --nodes 1 --gpus 1 --auto-rows 4
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench" / "common"))


def skeleton_shape(shape: str, micro: int, seq: int, checkpointed: float):
    import tempfile

    import torch

    from make_moe import SHAPES, moe_config
    from trainer import layout
    from trainer.config import load_recipe
    from trainer.model import build_skeleton

    kind, dims = SHAPES[shape]
    config = moe_config(kind, dims["hidden"], dims["layers"], dims["experts"], dims["top_k"],
                        dims["expert_intermediate"], dims["heads"], dims["vocab"], dims.get("kv_heads", 0),
                        dims.get("head_dim", 0), dims.get("intermediate", 0))
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        recipe = load_recipe(None, [f"train.micro_batch_size={micro}", f"data.max_length={seq}", "lora.r=16",
                                    "lora.alpha=32", f"model.activation_checkpointing={checkpointed}"],
                             node_files=False)
        model = build_skeleton(recipe, Path(folder), torch.bfloat16)
    return layout.shape_of(model, recipe)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="glm-4.5-air")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--micro", type=int, default=1)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--checkpointed", type=float, default=1.0)
    parser.add_argument("--memory-gb", type=float, default=150.1, help="one GPU (an H200: 150.1 GB)")
    parser.add_argument("--compute-s", type=float, default=1.96)
    parser.add_argument("--nvlink-gbs", type=float, default=350.0)
    parser.add_argument("--network-gbs", type=float, default=12.5)
    parser.add_argument("--auto-rows", type=int, default=0, help="rows per rank and step: print auto's split")
    args = parser.parse_args()
    from trainer import layout

    shape = skeleton_shape(args.shape, args.micro, args.seq, args.checkpointed)
    world = args.nodes * args.gpus
    if args.auto_rows:
        auto_split(args, shape, world)
        return
    auto = layout.choose("auto", shape, args.memory_gb * 1e9, world, args.nodes, args.gpus)
    print(f"{args.shape}: {shape.frozen_bytes / 1e9:.1f} GB frozen ({shape.expert_bytes / 1e9:.1f} GB routed "
          f"experts), {shape.trainable / 1e9:.2f}B LoRA parameters; {args.nodes} nodes x {args.gpus} GPUs, "
          f"micro-batch {args.micro} x {args.seq}, {shape.checkpointed}/{shape.layers} layers checkpointed")
    print(f"auto: {auto.describe()}")
    print(f"{'layout':14} {'GB/GPU':>7} {'inside GB':>10} {'across GB':>10} {'node out GB':>12} {'NVLink s':>9} "
          f"{'network s':>10} {'step s (overlapped .. serial)':>30}")
    for name in ("replicate", "hsdp", "fsdp", "expert", "expert-global"):
        chosen = layout.Layout(name, world, args.nodes, args.gpus, "")
        memory = layout.per_gpu_bytes(name, shape, world, args.gpus) / 1e9
        sent = layout.traffic(chosen, shape, True)
        inside, across = sent["intra_node_bytes"] / 1e9, sent["inter_node_bytes"] / 1e9
        node_out = across * args.gpus
        nvlink, network = inside / args.nvlink_gbs, node_out / args.network_gbs
        low, high = max(args.compute_s, nvlink, network), args.compute_s + nvlink + network
        fits = "" if memory <= layout.FITS * args.memory_gb else "  (does not fit)"
        print(f"{name:14} {memory:7.0f} {inside:10.1f} {across:10.2f} {node_out:12.1f} {nvlink:9.2f} {network:10.2f} "
              f"{low:14.2f} .. {high:6.2f}{fits}")


def auto_split(args, shape, world: int) -> None:
    import dataclasses

    from trainer import layout
    from trainer.model import checkpointed_layers

    memory = args.memory_gb * 1e9
    chosen, split = layout.plan("auto", shape, memory, world, args.nodes, args.gpus, rows=args.auto_rows,
                                max_length=args.seq, micro=None, share=None)
    print(f"{args.shape}: {args.nodes} node(s) x {args.gpus} GPU(s) of {args.memory_gb:.0f} GB, {args.auto_rows} "
          f"row(s) of {args.seq} tokens per rank and step")
    print(chosen.describe())
    print(split.reason)
    print(f"{'micro':>5} " + " ".join(f"{f'{s:.0%} ckpt':>17}" for s in layout.CHECKPOINT_SHARES)
          + "   (est. GB per GPU / us per token; * does not fit)")
    for micro in (m for m in range(args.auto_rows, 0, -1) if args.auto_rows % m == 0):
        cells = []
        for share in layout.CHECKPOINT_SHARES:
            trial = dataclasses.replace(shape, tokens=micro * args.seq,
                                        checkpointed=len(checkpointed_layers(shape.layers, share)))
            need = layout.per_gpu_bytes(chosen.name, trial, world, args.gpus)
            pace = layout.seconds_per_token(chosen.name, trial, world, args.nodes, args.gpus)
            mark = "*" if need > layout.FITS * memory else " "
            cells.append(f"{need / 1e9:6.0f}{mark}/{pace * 1e6:7.1f}  ")
        print(f"{micro:5} " + " ".join(f"{c:>17}" for c in cells))


if __name__ == "__main__":
    main()
