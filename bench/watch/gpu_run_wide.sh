#!/usr/bin/env bash
# On the GPU machine (1 GPU, local transport): a slowdown of every rank named with its cause (issue 68). The built-in
# trainer (gpu_common.sh's random 8-layer Llama) runs attached; after $BEFORE s (90) another process
# (bench/watch/scripts/gpu_burner.py) starts multiplying matrices on the same GPU. Printed: the seconds until the
# attached launch's run-wide line names that process (pid, user), that line, and `status` and `top --once` as a user
# sees them then. Needs nodectl's pure-Python dependencies (carry .whl). Output in $OUT.
set -uo pipefail
source "$(dirname "$0")/../common/gpu_common.sh"
OUT=${OUT:-$REPO/gpu-run-wide}; mkdir -p "$OUT"
work=$(mktemp -d); mkdir -p "$work/models" "$work/proj"; cd "$work/proj"
export NODECTL_STATE_DIR=$work/state
make_model "$work/models/m"
write_recipe "$work/models/m" 100000
printf 'nodes:\n  - {host: localhost, name: node0, transport: local, device: cuda, gpus: 1, python: python3, workdir: %s/n0}\n' \
  "$work" > hosts.yaml
python3 -m nodectl launch --skip-preflight --config recipe.yaml > "$OUT/launch.out" 2> "$OUT/launch.err" &
launch=$!
sleep "${BEFORE:-90}"
python3 "$REPO/bench/watch/scripts/gpu_burner.py" > "$OUT/burner.log" 2>&1 &
burner=$!
started=$(date +%s.%N)
for _ in $(seq 1 150); do grep -q "another process on GPU" "$OUT/launch.err" && break; sleep 1; done
named=$(date +%s.%N)
python3 -m nodectl status > "$OUT/status.txt" 2>&1
python3 -m nodectl top --once > "$OUT/top.txt" 2>&1
{
  echo "the other process: pid $burner, started $(python3 -c "print(f'{$started - 0:.0f}')")"
  if grep -q "another process on GPU" "$OUT/launch.err"; then
    echo "named by the attached launch $(python3 -c "print(f'{$named - $started:.1f}')") s after it started"
  else
    echo "not named within 150 s"
  fi
  grep -E "every rank is slower|straggler" "$OUT/launch.err" | head -3
  grep -E "pace|every rank|another process" "$OUT/status.txt" | head -5
} > "$OUT/verdict.txt"
kill "$burner"; python3 -m nodectl stop > /dev/null 2>&1; wait "$launch"
cat "$OUT/verdict.txt"; tail -5 "$OUT/launch.err"; cat "$OUT/top.txt"
