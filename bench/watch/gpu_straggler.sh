#!/usr/bin/env bash
# On the GPU machine (2 GPUs, local transport: one "node" with both): the straggler verdict (issue 51).
#  1. The cost of the measurement: the built-in trainer (a random 8-layer Llama of hidden 2048, rows of 2048 tokens)
#     run twice, pace off (NODECTL_PACE_EVERY=0, TORCH_NCCL_ENABLE_TIMING=0) and on (the default), alternated twice
#     (off, on, off, on); tokens/s per GPU from the wall clock between metrics records after warm-up.
#  2. The verdict: the same run, and after 60 s another process (bench/watch/scripts/gpu_burner.py) starts multiplying
#     matrices on GPU 1; the seconds until the attached launch names rank 1 and "another process ... on GPU 1".
# Needs nodectl's pure-Python dependencies: pip install --no-index --find-links .whl ... (carry .whl). Output in $OUT.
set -uo pipefail
source "$(dirname "$0")/../common/gpu_common.sh"
OUT=${OUT:-$REPO/gpu-straggler}; mkdir -p "$OUT"
STEPS=${STEPS:-160}
work=$(mktemp -d); mkdir -p "$work/models" "$work/proj"; cd "$work/proj"
export NODECTL_STATE_DIR=$work/state
make_model "$work/models/m"
write_recipe "$work/models/m" "$STEPS"
inventory() {  # $1: extra env of the node
  printf 'nodes:\n  - {host: localhost, name: node0, transport: local, device: cuda, gpus: 2, python: python3, workdir: %s/n0, env: {%s}}\n' \
    "$work" "$1" > hosts.yaml
}
run_once() {  # $1 label, $2 env; prints tokens/s per GPU
  inventory "$2"
  python3 -m nodectl launch --skip-preflight --config recipe.yaml > "$OUT/$1.out" 2> "$OUT/$1.err"
  local id; id=$(ls -t runs | head -1)
  rate "$work/n0/runs/$id/output/metrics.jsonl" 2>>"$OUT/$1.err" || echo "?"
}
: > "$OUT/cost.txt"
for i in 1 2; do
  off=$(run_once "off$i" "NODECTL_PACE_EVERY: '0', TORCH_NCCL_ENABLE_TIMING: '0'")
  on=$(run_once "on$i" "")
  echo "pair $i: pace off $off tok/s/gpu, pace on $on tok/s/gpu" | tee -a "$OUT/cost.txt"
done
python3 - "$OUT/cost.txt" <<'PY' | tee -a "$OUT/cost.txt"
import re, sys
pairs = [tuple(map(float, re.findall(r"([\d.]+) tok/s/gpu", line))) for line in open(sys.argv[1]) if "pair" in line]
off, on = sum(p[0] for p in pairs) / len(pairs), sum(p[1] for p in pairs) / len(pairs)
print(f"mean: pace off {off:.1f}, pace on {on:.1f} tok/s/gpu: on/off {on / off:.3f}")
PY

# the verdict: another process on GPU 1 from 60 s on
inventory ""
sed -i "s/steps: $STEPS/steps: 100000/" recipe.yaml
python3 -m nodectl launch --skip-preflight --config recipe.yaml > "$OUT/verdict.out" 2> "$OUT/verdict.err" &
launch=$!
sleep 60
CUDA_VISIBLE_DEVICES=1 python3 "$REPO/bench/watch/scripts/gpu_burner.py" > "$OUT/burner.log" 2>&1 &
burner=$!
started=$(date +%s.%N)
for i in $(seq 1 120); do
  grep -q "straggler: rank 1" "$OUT/verdict.err" && break; sleep 1
done
named=$(date +%s.%N)
grep "straggler" "$OUT/verdict.err" | head -3 > "$OUT/verdict.txt"
python3 -m nodectl --json status > "$OUT/status.json" 2>&1
python3 -m nodectl status > "$OUT/status.txt" 2>&1
echo "named $(python3 -c "print(f'{$named - $started:.1f}')") s after the other process started on GPU 1" >> "$OUT/verdict.txt"
kill $burner; python3 -m nodectl stop > /dev/null 2>&1; wait $launch
cat "$OUT/cost.txt" "$OUT/verdict.txt" "$OUT/status.txt"
