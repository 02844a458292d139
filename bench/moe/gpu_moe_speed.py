"""Mixture-of-Experts LoRA throughput: the plain transformers + peft script against the trainer, side by side in
one run, on one GPU (issue 25). On the GPU machine:

    python3 bench/moe/gpu_moe_speed.py --work /tmp/w --shape qwen3-30b-a3b --steps 30 --ref-batch 8 \\
        --run grouped:train.micro_batch_size=2,model.activation_checkpointing=0.4,model.compile=true \\
        --run peft:train.micro_batch_size=2,model.activation_checkpointing=true,model.moe_kernel=peft \\
        --compare grouped,peft

Writes the shape's config (random weights: model.init random for the trainer, transformers' initialisation on
the GPU for the reference), the demo tokenizer and --examples random texts of --seq + 4 characters (every row
--seq tokens, nothing padded), then runs:
  ref   bench/common/ref_plain_lora.py --expert-lora --random-init at --ref-batch rows (its fastest, with
        non-reentrant activation checkpointing; --ref-noac for none), --ref-steps steps;
  each --run NAME:KEY=VALUE,...  the trainer (`python -m trainer` under torchrun) with those recipe overrides on
        top of: LoRA r 16 / alpha 32 on attention and the routed experts only (TARGETS; expert_r 16: gate_up 32),
        lr 2e-4, --steps steps, a record every step;
  each --launch NAME:NxG:KEY=VALUE,...  the same through `nodectl launch --nodes N --gpus G` on this machine's
        local "nodes" (each its own CUDA_VISIBLE_DEVICES), e.g. 2x1 against 1x2 for the cost of the node boundary.
and prints for each: tokens/s per GPU by wall clock (real tokens over the time between consecutive records,
median after --skip steps) beside the program's own figure, the ratio to the reference, MFU over the active
parameters (the trainer's formula; the reference's from the same FLOPs per token), peak memory; then, for
--compare A,B, the loss of A and B at every step and the largest difference. With --rounds R (and --no-ref for a
gain under 10%), the --run runs go A B B A R times after a warm-up launch, and each gets a median with its spread
and, against the first, the ratio of its adjacent pairs and whether the gain is beyond that spread:

    python3 bench/moe/gpu_moe_speed.py --work /tmp/w --no-ref --rounds 2 \\
        --run bf16:model.compile=true --run fp8:model.compile=true,model.fp8_experts=true
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from gpu_train import by_gaps, jsonl, median_after, run  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
COMMON = REPO / "bench" / "common"   # the model makers and the reference script


# The recipe's LoRA targets, written out: with no --config the trainer starts from its demo recipe, which also
# adapts lm_head (a 151,936-row output layer at these shapes). The reference adapts attention and the routed experts
# only; so do these runs unless a run's own sets say otherwise (the figures before commit 981670f of 2026-11-28 had
# lm_head adapted too: `lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head]`).
TARGETS = "lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"


def recipe_defaults(model: Path, args) -> list[str]:
    return [f"model.path={model}", "model.init=random", f"data.path={model / 'train.jsonl'}",
            f"data.max_length={args.seq}", "lora.r=16", "lora.alpha=32", "lora.dropout=0.0", TARGETS,
            "train.lr=2e-4", "train.warmup_steps=5", "train.weight_decay=0.0", f"train.steps={args.steps}",
            "train.log_every=1"]


def assignments(spec: str) -> list[str]:
    """KEY=VALUE,KEY=VALUE,...: split at the commas that start a new KEY=, so a YAML list value keeps its own."""
    return [s for s in re.split(r",(?=[\w.]+=)", spec) if s]


def trainer_run(name: str, sets: list[str], args, model: Path, work: Path, env: dict) -> dict:
    out = work / name
    shutil.rmtree(out, ignore_errors=True)   # a run of an earlier call there would resume at its end and be read again
    defaults = recipe_defaults(model, args) + [f"train.output_dir={out}"]
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.gpus), "--master-port",
            "29613", "-m", "trainer"]
    for assignment in defaults + sets:
        argv += ["--set", assignment]
    code = run(argv, REPO, env, work / f"{name}.log", args.timeout)
    steps = [r for r in jsonl(out / "metrics.jsonl") if "loss" in r and "tokens_per_s_per_gpu" in r]
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    return {"exit": code, "steps": steps, "summary": summary, "world": args.gpus, "sets": sets}


def launch_run(name: str, layout: str, sets: list[str], args, model: Path, work: Path, env: dict) -> dict:
    """The trainer through `nodectl launch --nodes N --gpus G` on this machine's local "nodes" (NxG in `layout`),
    with the same defaults as trainer_run; the records are read from node 0's output."""
    nodes, gpus = (int(x) for x in layout.lower().split("x"))
    project = work / f"project-{name}"
    project.mkdir(parents=True, exist_ok=True)
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    defaults = recipe_defaults(model, args) + ["train.checkpoint_every=0", "train.checkpoint_minutes=0",
                                               f"train.traffic_at={args.traffic_at}"]
    argv = [sys.executable, "-m", "nodectl", "launch", "--nodes", str(nodes), "--gpus", str(gpus), "--skip-preflight"]
    for assignment in defaults + sets:
        argv += ["--set", assignment]
    code = run(argv, project, env, work / f"{name}.log", args.timeout)
    runs = sorted(p.name for p in (project / "runs").iterdir() if p.name[0].isdigit()) if (project / "runs").is_dir() else []
    if not runs:
        return {"exit": code, "steps": [], "world": nodes * gpus, "sets": sets}
    run_dir = Path(env.get("HOME", "~")).expanduser() / ".nodectl" / "local" / "runs" / runs[-1]
    node0 = run_dir / "local0" / "output" if (run_dir / "local0").is_dir() else run_dir / "output"
    records = jsonl(node0 / "metrics.jsonl")
    steps = [r for r in records if "loss" in r and "tokens_per_s_per_gpu" in r]
    summary = json.loads((node0 / "summary.json").read_text()) if (node0 / "summary.json").exists() else {}
    log = (work / f"{name}.log").read_text(errors="replace") if (work / f"{name}.log").exists() else ""
    chose = next((line.split("layout: ", 1)[1].strip() for line in log.splitlines() if "layout: " in line), "")
    return {"exit": code, "steps": steps, "summary": summary, "world": nodes * gpus, "sets": [layout] + sets,
            "layout": chose, "traffic": next((r for r in records if r.get("event") == "traffic"), {})}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--model", type=Path, default=None, help="a model folder with its own train.jsonl (e.g. "
                        "bench/moe/make_trained_moe.py's) instead of --shape's random one; runs set model.init=checkpoint")
    parser.add_argument("--tiny", action="store_true", help="a small model of the same layout (CPU is fine)")
    parser.add_argument("--layers", type=int, default=0, help="only this many of the shape's layers (what one GPU holds)")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--examples", type=int, default=400)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=5, help="steps left out of the medians (warm-up, compilation)")
    parser.add_argument("--ref-batch", default="8,4", help="rows per step; the first of these that fits")
    parser.add_argument("--ref-steps", type=int, default=0, help="steps of the reference (default: --steps)")
    parser.add_argument("--ref-noac", action="store_true")
    parser.add_argument("--no-ref", action="store_true")
    parser.add_argument("--run", action="append", default=[], help="NAME:section.key=value,...")
    parser.add_argument("--rounds", type=int, default=0, help="run the --run runs R times forward and back (A B B A) "
                        "after --warmup launches, and give each a median with its spread and each pair's ratios")
    parser.add_argument("--warmup", type=int, default=1, help="launches of the first --run before the rounds, "
                        "not counted (a call's first launch ran 8-13%% slow)")
    parser.add_argument("--launch", action="append", default=[],
                        help="NAME:NxG:section.key=value,...: the trainer through `nodectl launch --nodes N --gpus G`")
    parser.add_argument("--compare", action="append", default=[], help="A,B: step-by-step loss of two runs (repeatable)")
    parser.add_argument("--base", default="", help="NAME: the run each --launch run's tokens/s per GPU is divided by "
                        "(the scaling table: ratio, bytes per step inside and across nodes, counted and modelled)")
    parser.add_argument("--traffic-at", type=int, default=3, help="the --launch runs' step whose collectives are counted")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", type=Path, default=None, help="the figures' JSON (default: WORK/gpu_moe_speed.json)")
    args = parser.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}  # as nodectl sets it; the reference's best too
    if args.model:
        args.shape = args.model.name   # the report's title
    model = args.model.resolve() if args.model else \
        work / ("model-tiny" if args.tiny else f"model-{args.shape}" + (f"-{args.layers}l" if args.layers else ""))
    if not (model / "config.json").exists():
        shape = ["--layout", "qwen3_moe", "--hidden", "64", "--layers", "2", "--experts", "8", "--top-k", "2",
                 "--expert-intermediate", "32", "--heads", "4"] if args.tiny else ["--shape", args.shape, "--shape-layers", str(args.layers)]
        if run([sys.executable, str(COMMON / "make_moe.py"), str(model), *shape, "--no-weights",
                "--examples", str(args.examples), "--chars", str(args.seq + 4)], REPO, env, work / "make.log",
               args.timeout):
            sys.exit(1)
    results: dict = {}
    for batch in ([] if args.no_ref else [int(b) for b in args.ref_batch.split(",")]):  # the first that fits
        flags = ["--random-init", "--expert-lora"] + (["--no-checkpointing"] if args.ref_noac else [])
        code = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.gpus),
                    "--master-port", "29611", str(COMMON / "ref_plain_lora.py"), "--model", str(model),
                    "--data", str(model / "train.jsonl"), "--seq", str(args.seq), "--batch", str(batch),
                    "--steps", str(args.ref_steps or args.steps), "--lr", "2e-4", "--out", str(work / "ref.jsonl"),
                    *flags], REPO, env, work / "ref.log", args.timeout)
        results["ref"] = {"exit": code, "steps": jsonl(work / "ref.jsonl"), "world": args.gpus, "batch": batch}
        if code == 0:
            break
    figures = args.out or work / "gpu_moe_speed.json"
    figures.write_text(json.dumps(results, indent=1))
    for key, name, sets in run_order(args.run, args.rounds, args.warmup):
        results[key] = trainer_run(key, assignments(sets), args, model, work, env)
        results[key]["run"] = name
        figures.write_text(json.dumps(results, indent=1))  # what finished survives a cut-off
    for spec in args.launch:
        name, layout, sets = (spec.split(":", 2) + [""])[:3]
        results[name] = launch_run(name, layout, assignments(sets), args, model, work, env)
        figures.write_text(json.dumps(results, indent=1))
    report(results, args)
    if args.rounds:
        rounds_report(results, args)
    figures.write_text(json.dumps(results, indent=1))
    print(f"figures: {figures}")


def run_order(specs: list[str], rounds: int, warmup: int) -> list[tuple[str, str, str]]:
    """(result key, run name, overrides) in the order they run. With --rounds R: --warmup launches of the first run
    (kept apart as warmup, warmup.2, ...), then R rounds of every run forward and back (A B B A; A B C C B A), each
    execution keyed NAME.1, NAME.2, ... Without, each run once under its own name."""
    runs = [(spec.partition(":")[0], spec.partition(":")[2]) for spec in specs]
    if not rounds or not runs:
        return [(name, name, sets) for name, sets in runs]
    order = [("warmup" if i == 0 else f"warmup.{i + 1}", "warmup", runs[0][1]) for i in range(warmup)]
    seen: dict[str, int] = {}
    for _ in range(rounds):
        for name, sets in runs + runs[::-1]:
            seen[name] = seen.get(name, 0) + 1
            order.append((f"{name}.{seen[name]}", name, sets))
    return order


def rounds_report(results: dict, args) -> None:
    """Each run's tokens/s per GPU by wall over its executions (median, min-max), and every other run against the
    first: the ratio of medians, the ratios of the adjacent pairs of the A B B A order, and whether the gain is
    beyond the spread (the range of the pairs' ratios keeps to one side of 1)."""
    names = [spec.partition(":")[0] for spec in args.run]
    figures = {name: [] for name in names}
    sequence = []
    for key, result in results.items():
        if result.get("run") in figures:
            rate = by_gaps(result.get("steps", []), args.skip, result["world"])
            if rate:
                figures[result["run"]].append(rate)
                sequence.append((result["run"], rate))
    print(f"\n== {args.rounds} round(s) of {' '.join(names + names[::-1])} after {args.warmup} warm-up launch(es): "
          f"tokens/s per GPU by wall, median (min-max, n)")
    for name in names:
        rates = figures[name]
        if rates:
            print(f"   {name:10} {statistics.median(rates):>9,.0f}  ({min(rates):,.0f}-{max(rates):,.0f}, n={len(rates)})")
    base = names[0]
    for name in names[1:]:
        if not (figures[name] and figures[base]):
            continue
        pairs = [b / a if first == base else a / b
                 for (first, a), (second, b) in zip(sequence, sequence[1:])
                 if {first, second} == {base, name}]
        ratio = statistics.median(figures[name]) / statistics.median(figures[base])
        if pairs:
            low, high = min(pairs), max(pairs)
            verdict = "beyond the spread" if low > 1 or high < 1 else "inside the spread: no claimed gain"
            print(f"   {name} / {base}: {ratio:.3f}x (adjacent pairs {low:.3f}-{high:.3f}x, n={len(pairs)}): {verdict}")


def report(results: dict, args) -> None:
    print(f"\n== {args.shape}{' (tiny)' if args.tiny else ''}{f', {args.layers} layers' if args.layers else ''}, rows of {args.seq} tokens, {args.gpus} GPU(s); "
          f"tokens/s per GPU, median after step {args.skip}")
    print("   by wall: real tokens / wall time between consecutive records; reported: the program's own figure")
    gaps = {name: by_gaps(r.get("steps", []), args.skip, r["world"]) for name, r in results.items()}
    ref = gaps.get("ref")
    # MFU of the reference from the trainer's FLOPs per token (same model, rows and adapters)
    per_token = next((median_after(r["steps"], args.skip, "mfu") / median_after(r["steps"], args.skip,
                      "tokens_per_s_per_gpu") for n, r in results.items()
                      if n != "ref" and median_after(r.get("steps", []), args.skip, "mfu")), None)
    for name, result in results.items():
        steps = result.get("steps", [])
        reported = median_after(steps, args.skip, "tokens_per_s_per_gpu")
        wall = gaps[name]
        mfu = median_after(steps, args.skip, "mfu") or (per_token * wall if per_token and wall else None)
        memory = max((s.get("max_memory_gb") or 0 for s in steps), default=0)
        ratio = f"{wall / ref:.2f}x ref" if wall and ref else ""
        sets = ",".join(s for s in result.get("sets", []) if not s.startswith(("train.lr", "lora.")))
        step_s = median_after(steps, args.skip, "step_time_s")
        saved = result.get("summary", {}).get("adapter", {})
        print(f"   {name:10} exit {result['exit']}  by wall {wall or 0:>7.0f}  reported {reported or 0:>7.0f}  "
              f"{ratio:9}  MFU {100 * (mfu or 0):5.1f}%  peak {memory:5.1f} GB  {step_s or 0:.2f} s/step  "
              + (f"adapter saved in {saved['seconds']:.1f}s ({saved.get('gathered_bytes', 0) / 2**20:.0f} MiB)  "
                 if saved.get("seconds") is not None else "")
              + f"{'batch ' + str(result.get('batch')) if name == 'ref' else sets}")
    if args.base:
        scaling(results, gaps, args)
    for pair in args.compare:
        a, b = pair.split(",")
        la = {s["step"]: s["loss"] for s in results.get(a, {}).get("steps", [])}
        lb = {s["step"]: s["loss"] for s in results.get(b, {}).get("steps", [])}
        common = sorted(set(la) & set(lb))
        if common:
            diffs = [abs(la[s] - lb[s]) for s in common]
            print(f"\n== loss, {a} vs {b}, {len(common)} steps from the same seed: max |diff| {max(diffs):.4f} "
                  f"(step {common[diffs.index(max(diffs))]}), mean {sum(diffs) / len(diffs):.4f}")
            for s in common:
                print(f"   step {s:>3}  {a} {la[s]:.4f}  {b} {lb[s]:.4f}  diff {la[s] - lb[s]:+.4f}")


def scaling(results: dict, gaps: dict, args) -> None:
    """Per-GPU throughput against --base, the layout each run chose, and what one step sends per GPU (counted from
    the step's collectives, and the layout's own figure), inside a node and across nodes."""
    base = gaps.get(args.base)
    print(f"\n== scaling against {args.base} ({base or 0:.0f} tokens/s per GPU by wall); bytes one GPU sends in "
          f"step {args.traffic_at}, GB: counted (layout's figure)")
    for name, result in results.items():
        if "layout" not in result:
            continue
        wall, traffic = gaps.get(name), result.get("traffic", {})

        def gb(kind: str) -> str:
            counted, modelled = traffic.get(f"counted_{kind}_node_bytes"), traffic.get(f"layout_{kind}_node_bytes")
            if counted is None:
                return "      -"
            return f"{counted / 1e9:7.2f}" + (f" ({modelled / 1e9:.2f})" if modelled is not None else "")

        ratio = f"{wall / base:.2f}x" if wall and base else "  -  "
        fsdp = traffic.get("layout_fsdp_inter_node_bytes")
        versus = f" (fsdp over all: {fsdp / 1e9:.1f})" if fsdp else ""
        print(f"   {name:10} {result['sets'][0]:>4}  {wall or 0:>7.0f} tok/s/GPU  {ratio:>6}  inside {gb('intra'):>16}"
              f"  across {gb('inter'):>16}{versus}  {result.get('layout', '')[:110]}")


if __name__ == "__main__":
    main()
