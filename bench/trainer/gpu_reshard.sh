#!/usr/bin/env bash
# On the GPU machine (2+ GPUs): a checkpoint written by 2 NCCL ranks continues on 1 rank from its replica.pt
# (what `launch --max-restarts --exclude-failed` relies on), with the checkpoint's time and size. Output in $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$REPO/gpu-reshard}; mkdir -p "$OUT"
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
work=$(mktemp -d)
python3 "$REPO/bench/common/make_llama.py" "$work/m" --examples 256 --chars 2100 > "$OUT/model.log" 2>&1  # ~1B Llama shape
cat > "$work/r.yaml" <<YAML
model: {path: $work/m, activation_checkpointing: false}
lora: {r: 16, alpha: 32}
data: {path: $work/m/train.jsonl, max_length: 2048}
train: {steps: ${STEPS1:-20}, micro_batch_size: 4, log_every: 5, checkpoint_every: 10, output_dir: $work/out}
YAML
run() { python3 -m torch.distributed.run --nproc-per-node "$1" --master-port "$2" -m trainer --config "$work/r.yaml" \
  --set "train.steps=$3"; }
run 2 29611 20 > "$OUT/two-ranks.log" 2>&1; echo "two ranks: exit $?"
ls -la "$work/out/checkpoints/ckpt-0000020" | tee "$OUT/checkpoint-files.txt"
run 1 29612 30 > "$OUT/one-rank.log" 2>&1; echo "one rank: exit $?"
grep -hE "resharded|resuming|checkpoint_s|^step +(20|25|30) " "$OUT/two-ranks.log" "$OUT/one-rank.log"
