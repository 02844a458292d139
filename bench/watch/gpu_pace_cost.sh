#!/usr/bin/env bash
# On a 4-GPU machine: what the pace measurement costs the built-in trainer (issue 51), side by side in time. Two
# 2-GPU runs at once, one on GPUs 0,1 and one on GPUs 2,3 (each a local "node"), one with the pace off
# (NODECTL_PACE_EVERY=0, TORCH_NCCL_ENABLE_TIMING=0), one on; then again with the settings swapped between the GPU
# pairs. Both runs of a round share the machine's moment (clocks, host load), and the swap cancels the pairs'
# difference: cost = geometric mean of the two rounds' on/off. Tokens/s per GPU from the wall clock between
# metrics records after step 30. Needs nodectl's pure-Python dependencies (carry .whl). Output in $OUT.
set -uo pipefail
source "$(dirname "$0")/../common/gpu_common.sh"
OUT=${OUT:-$REPO/gpu-pace-cost}; mkdir -p "$OUT"
STEPS=${STEPS:-200}; ROUNDS=${ROUNDS:-2}
ON=${ON:-}   # the "on" side's extra env (e.g. ", TORCH_NCCL_ENABLE_TIMING: '0'": the pace thread alone)
BOTH=${BOTH:-}   # extra env of both sides (e.g. ", TORCH_FR_BUFFER_SIZE: '400'")
work=$(mktemp -d); mkdir -p "$work/models"
make_model "$work/models/m"
start() {  # $1 name, $2 GPUs, $3 env of the node; the run in $work/$1
  mkdir -p "$work/$1"; cd "$work/$1"
  write_recipe "$work/models/m" "$STEPS"
  printf 'nodes:\n  - {host: localhost, name: %s, transport: local, device: cuda, gpus: 2, python: python3, workdir: %s/n, env: {CUDA_VISIBLE_DEVICES: "%s"%s}}\n' \
    "$1" "$work/$1" "$2" "$3" > hosts.yaml
  NODECTL_STATE_DIR=$work/state-$1 python3 -m nodectl launch --skip-preflight --config recipe.yaml > "$OUT/$1.out" 2> "$OUT/$1.err" &
  cd - > /dev/null
}
measured() { local id; id=$(ls -t "$work/$1/runs" | head -1); rate "$work/$1/n/runs/$id/output/metrics.jsonl"; }
OFF=", NODECTL_PACE_EVERY: '0', TORCH_NCCL_ENABLE_TIMING: '0'"
: > "$OUT/cost.txt"
for round in $(seq 1 "$ROUNDS"); do
  if [ $((round % 2)) -eq 1 ]; then on_gpus=0,1; off_gpus=2,3; else on_gpus=2,3; off_gpus=0,1; fi
  start "on$round" "$on_gpus" "$ON$BOTH"; start "off$round" "$off_gpus" "$OFF$BOTH"; wait
  on=$(measured "on$round"); off=$(measured "off$round")
  grep -ho '"copy_ms": [0-9.]*' "$work/on$round"/n/runs/*/flight/rank0.pace.json 2>/dev/null | head -1 | sed "s/^/round $round rank 0's last pace copy: /" | tee -a "$OUT/cost.txt"
  echo "round $round: pace on (GPUs $on_gpus) $on, pace off (GPUs $off_gpus) $off tok/s/gpu: on/off $(python3 -c "print(f'{$on / $off:.4f}')")" | tee -a "$OUT/cost.txt"
done
python3 - "$OUT/cost.txt" <<'PY' | tee -a "$OUT/cost.txt"
import math, re, sys
ratios = [float(m[1]) for m in re.finditer(r"on/off ([\d.]+)", open(sys.argv[1]).read())]
print(f"cost: on/off geometric mean over {len(ratios)} rounds {math.exp(sum(map(math.log, ratios)) / len(ratios)):.4f}")
PY
