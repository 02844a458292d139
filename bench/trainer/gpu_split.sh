#!/usr/bin/env bash
# On the GPU machine (2 GPUs, local transport: one "node" with both): where a run's time goes (issue 51). A
# default-tier preflight records the all-reduce's bus bandwidth on these GPUs in the history; then the built-in
# trainer (a random 8-layer Llama of hidden 2048, rows of 2048 tokens) runs attached, and `status` during the run
# says where the median rank's time goes and what its collectives move against preflight's figure. Output in $OUT.
# Needs nodectl's pure-Python dependencies: pip install --no-index --find-links .whl ... (carry .whl).
set -uo pipefail
source "$(dirname "$0")/../common/gpu_common.sh"
OUT=${OUT:-$REPO/gpu-split}; mkdir -p "$OUT"
STEPS=${STEPS:-400}
work=$(mktemp -d); mkdir -p "$work/models" "$work/proj"; cd "$work/proj"
export NODECTL_STATE_DIR=$work/state
make_model "$work/models/m"
write_recipe "$work/models/m" "$STEPS"
printf 'nodes:\n  - {host: localhost, name: node0, transport: local, device: cuda, gpus: 2, python: python3, workdir: %s/n0}\n' \
  "$work" > hosts.yaml
python3 -m nodectl --json preflight > "$OUT/preflight.json" 2> "$OUT/preflight.err"
echo "preflight exit $?: $(python3 -c "
import json; d = json.load(open('$OUT/preflight.json')); c = d.get('collective') or {}
print([(s.get('bytes'), s.get('busbw_gbs')) for s in c.get('sizes', [])][-3:], d.get('history'))")" | tee "$OUT/summary.txt"
python3 -m nodectl launch --skip-preflight --config recipe.yaml > "$OUT/launch.out" 2> "$OUT/launch.err" &
launch=$!
sleep 75
python3 -m nodectl status > "$OUT/status.txt" 2>&1
python3 -m nodectl --json status > "$OUT/status.json" 2>&1
sleep 20
python3 -m nodectl top --once > "$OUT/top.txt" 2>&1
wait $launch; echo "launch exit $?" >> "$OUT/summary.txt"
python3 -m nodectl collect > /dev/null 2>&1; python3 -m nodectl report > "$OUT/report.txt" 2>&1
cp runs/*/report/pace.png "$OUT/" 2>/dev/null
cp runs/*/pace.jsonl "$OUT/" 2>/dev/null
cat "$OUT/summary.txt" "$OUT/status.txt" "$OUT/top.txt" "$OUT/report.txt"; tail -3 "$OUT/launch.out"
