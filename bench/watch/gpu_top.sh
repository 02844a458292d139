#!/usr/bin/env bash
# On the GPU machine (2+ GPUs, local transport: two local "nodes", one GPU each): `nodectl top` and `nodectl exec`
# against a live built-in-trainer run. Shows top's GPU columns (nvidia-smi on the node) next to nvidia-smi's own
# reading taken at the same moment, and that each rank is matched to its node's GPU. Output in $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$REPO/gpu-top}; mkdir -p "$OUT"
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} COLUMNS=160
NODECTL="python3 -m nodectl"
work=$(mktemp -d); mkdir -p "$work/models" "$work/proj"; cd "$work/proj"
python3 "$REPO/bench/common/make_llama.py" "$work/models/m" --examples 256 --chars 2100 --hidden 1024 --layers 8 \
  --heads 16 --intermediate 4096 > "$OUT/model.log" 2>&1
cat > recipe.yaml <<YAML
model: {path: $work/models/m, activation_checkpointing: false}
data: {path: $work/models/m/train.jsonl, max_length: 2048}
train: {steps: 400, micro_batch_size: 4, log_every: 5}
YAML
$NODECTL --json launch --nodes 2 --gpus 1 --skip-preflight --detach --config recipe.yaml > "$OUT/launch.json" \
  2> "$OUT/launch.err" || { cat "$OUT/launch.err"; exit 1; }
run=$(python3 -c "import json,sys;print(json.load(open(sys.argv[1]))['run_id'])" "$OUT/launch.json")
for i in $(seq 1 120); do  # until both ranks have logged steps
  n=$($NODECTL --json status --run "$run" 2>/dev/null | python3 -c "import json,sys;d=json.load(sys.stdin);print(min((r['step'] or 0) for r in d['ranks']))" 2>/dev/null)
  [ "${n:-0}" -ge 20 ] && break; sleep 1
done
{ date +%s.%N; nvidia-smi --query-gpu=index,utilization.gpu,memory.used,temperature.gpu,power.draw --format=csv,noheader; } > "$OUT/nvidia-smi.txt"
$NODECTL top --once --json --run "$run" > "$OUT/top.json" 2>&1
$NODECTL top --once --run "$run" > "$OUT/top.txt" 2>&1
$NODECTL exec --nodes 2 -- nvidia-smi --query-gpu=index,name --format=csv,noheader > "$OUT/exec.txt" 2>&1; echo "exit $?" >> "$OUT/exec.txt"
$NODECTL --json exec --nodes 2 'echo $CUDA_VISIBLE_DEVICES; nvidia-smi -L | wc -l' > "$OUT/exec.json" 2>&1
$NODECTL stop --run "$run" > "$OUT/stop.txt" 2>&1
cat "$OUT/nvidia-smi.txt" "$OUT/top.txt" "$OUT/exec.txt"
python3 - "$OUT/top.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["ranks"]:
    g = r.get("gpu") or {}
    print(f"rank {r['rank']} on {r['node']}: step {r['step']} loss {r['loss']} tok/s {r['tokens_per_s']} gpu {g.get('index')} util {g.get('util')} mem {g.get('mem_used_mib')} MiB")
PY
