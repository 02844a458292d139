# Sourced by the GPU benches of the built-in trainer (gpu_straggler.sh, gpu_split.sh, gpu_pace_cost.sh): the
# environment every command there keeps, the random 8-layer Llama (hidden 2048, rows of 2048 tokens) they train,
# its recipe, and tokens/s per GPU from the wall clock between metrics records after step 30.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} COLUMNS=200

make_model() {  # $1: folder; its log in $OUT/model.log
  python3 "$REPO/bench/common/make_llama.py" "$1" --examples 512 --chars 8400 --hidden 2048 --layers 8 \
    --heads 16 --intermediate 8192 > "$OUT/model.log" 2>&1 || { cat "$OUT/model.log"; exit 1; }
}

write_recipe() {  # $1: the model's folder, $2: steps; recipe.yaml in the current folder
  cat > recipe.yaml <<YAML
model: {path: $1, activation_checkpointing: false}
data: {path: $1/train.jsonl, max_length: 2048}
train: {steps: $2, micro_batch_size: 4, log_every: 5}
YAML
}

rate() {  # $1: a run's metrics.jsonl; prints tokens/s per GPU by the wall clock after step 30
  python3 - "$1" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
recs = [r for r in recs if r["step"] >= 30]
first, last = recs[0], recs[-1]
per_step = [r["tokens_per_s_per_gpu"] * r["step_time_s"] for r in recs]   # tokens per GPU per step
tokens = sum(per_step[1:]) / len(per_step[1:]) * (last["step"] - first["step"])
print(f"{tokens / (last['time'] - first['time']):.1f}")
PY
}
