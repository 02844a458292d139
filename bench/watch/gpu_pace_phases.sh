#!/usr/bin/env bash
# On a 2-GPU machine: what reading the ranks' pace costs the built-in trainer (issue 51), on and off in one run.
# One 2-GPU run through `nodectl launch` (pace on: each rank serves its flight recorder through torch's worker
# server, runctl reads it when the attached launch polls). After warm-up the bench alternates PHASE-second phases:
# the ranks' sockets where runctl finds them (the attached launch polls every second, runctl reads every rank's
# recorder every 5 s) and renamed away (runctl finds no server and keeps the last rows: the ranks train alone),
# PAIRS times. The launch polls all along, so only the reading differs. Same processes, GPUs and moment: cost = geometric
# mean over the pairs of (tokens/s while read) / (tokens/s while not), by the wall clock between metrics records
# inside each phase (its first 5 s left out). NCCL's timing (TORCH_NCCL_ENABLE_TIMING) is on in both phases:
# gpu_pace_cost.sh compares it on and off. Needs nodectl's pure-Python dependencies (carry .whl). Output in $OUT.
set -uo pipefail
source "$(dirname "$0")/../common/gpu_common.sh"
OUT=${OUT:-$REPO/gpu-pace-phases}; mkdir -p "$OUT"
PHASE=${PHASE:-30}; PAIRS=${PAIRS:-4}
ORDER=${ORDER:-"alone read"}   # the phases' order in each pair (the first pair's first phase is not skewed by warm-up)
work=$(mktemp -d); mkdir -p "$work/models" "$work/run"
make_model "$work/models/m"
cd "$work/run"
write_recipe "$work/models/m" 100000
real_smi=$(command -v nvidia-smi)   # each nvidia-smi the launch runs, timed, in $OUT/nvidia-smi.log
mkdir -p "$work/bin"; printf '#!/bin/sh\necho "$(date +%%s.%%N) $*" >> %s/nvidia-smi.log\nexec %s "$@"\n' "$OUT" "$real_smi" > "$work/bin/nvidia-smi"
chmod +x "$work/bin/nvidia-smi"
printf 'nodes:\n  - {host: localhost, name: local0, transport: local, device: cuda, gpus: 2, python: python3, workdir: %s/n, env: {CUDA_VISIBLE_DEVICES: "0,1"}}\n' \
  "$work/run" > hosts.yaml
PATH=$work/bin:$PATH NODECTL_STATE_DIR=$work/state python3 -m nodectl launch --skip-preflight --config recipe.yaml > "$OUT/launch.out" 2> "$OUT/launch.err" &
launch=$!
metrics() { ls -t "$work/run/n/runs/"*/output/metrics.jsonl 2>/dev/null | head -1; }
until [ -n "$(metrics)" ] && grep -q '"step": [4-9][0-9]' "$(metrics)"; do
  kill -0 $launch 2>/dev/null || { echo "the launch ended before step 40"; tail -30 "$OUT/launch.out" "$OUT/launch.err"; exit 1; }
  sleep 2
done
: > "$OUT/phases.txt"
for pair in $(seq 1 "$PAIRS"); do
  for state in $ORDER; do
    for sock in "$work/run/n/runs/"*/flight/rank*.sock*; do
      if [ $state = read ]; then mv "$sock" "${sock%.off}" 2>/dev/null; else mv "$sock" "${sock%.off}.off"; fi
    done
    echo "$state $(date +%s.%N)" >> "$OUT/phases.txt"; sleep "$PHASE"
  done
done
echo "end $(date +%s.%N)" >> "$OUT/phases.txt"
sleep 6
cp "$work/run/n/runs/"*/flight/rank*.pace.json "$OUT/" 2>/dev/null
kill -INT $launch; wait $launch
cp "$(metrics)" "$OUT/metrics.jsonl"
python3 - "$OUT/phases.txt" "$OUT/metrics.jsonl" <<'PY' | tee "$OUT/cost.txt"
import json, math, sys
marks = [line.split() for line in open(sys.argv[1])]
recs = [json.loads(l) for l in open(sys.argv[2]) if '"loss"' in l]
tokens = {r["step"]: r["tokens_per_s_per_gpu"] * r["step_time_s"] for r in recs}   # tokens per GPU per step
def rate(t0, t1):
    inside = [r for r in recs if t0 + 5 <= r["time"] <= t1]
    first, last = inside[0], inside[-1]
    per_step = sum(tokens[r["step"]] for r in inside[1:]) / len(inside[1:])
    return per_step * (last["step"] - first["step"]) / (last["time"] - first["time"])
rates = [(state, rate(float(t0), float(t1))) for (state, t0), (_, t1) in zip(marks, marks[1:])]
ratios = []
for (s1, r1), (s2, r2) in zip(rates[0::2], rates[1::2]):
    read, alone = (r1, r2) if s1 == "read" else (r2, r1)
    ratios.append(read / alone)
    print(f"pair {len(ratios)}: read {read:.1f}, alone {alone:.1f} tok/s/gpu: read/alone {read / alone:.4f}")
print(f"cost: read/alone geometric mean over {len(ratios)} pairs {math.exp(sum(map(math.log, ratios)) / len(ratios)):.4f}")
PY
for f in "$OUT"/rank*.pace.json; do python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], 'handlers', d.get('handlers'), 'copy_ms', d.get('copy_ms'), 'rows', len(d.get('entries') or []))" "$f"; done | tee -a "$OUT/cost.txt"
grep -c "WorkerServer" "$work/run/n/runs/"*/logs/*.log 2>/dev/null | sed 's/^/worker server lines in the rank logs: /' | tee -a "$OUT/cost.txt"
