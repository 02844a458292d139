#!/usr/bin/env bash
# On the GPU machine (2+ GPUs, local transport): preflight judges the GPUs each node's ranks will use.
#  a) two local "nodes", one GPU each: each probe sees only its share (CUDA_VISIBLE_DEVICES applied);
#  b) an inventory CUDA_VISIBLE_DEVICES naming a GPU the machine lacks fails on that node with the fix;
#  c) gpus: beyond what the node has fails, naming gpus: in hosts.yaml.
# Prints nvidia-smi -L beside the verdicts. Output in $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$REPO/gpu-visible}; mkdir -p "$OUT"
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} COLUMNS=160
work=$(mktemp -d); cd "$work"
python3 - <<'PY'
node = "  - {{host: localhost, name: {name}, transport: local, device: cuda, python: python3, workdir: {work}/{name}{extra}}}\n"
import os
work = os.getcwd()
open("shares.yaml", "w").write("nodes:\n" + "".join(node.format(name=f"n{i}", work=work, extra=", gpus: 1") for i in range(2)))
open("missing.yaml", "w").write("nodes:\n" + node.format(name="pinned", work=work, extra=", gpus: 2, env: {CUDA_VISIBLE_DEVICES: '1,7'}"))
open("beyond.yaml", "w").write("nodes:\n" + node.format(name="greedy", work=work, extra=", gpus: 4"))
PY
nvidia-smi -L | tee "$OUT/nvidia-smi.txt"
for case in shares missing beyond; do
  python3 -m nodectl -i "$case.yaml" --json preflight --quick > "$OUT/$case.json" 2> "$OUT/$case.err"
  echo "== $case: exit $?"
  python3 - "$OUT/$case.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["results"]:
    if r["check"] in ("gpus", "gpu idle"):
        print(f"  {r['node']:8} {r['check']:9} {r['verdict']:5} {r['detail']}")
for name, rep in (d.get("reports") or {}).items():
    g = rep.get("gpus") or {}
    print(f"  {name:8} probe: count {g.get('count')} of {g.get('count_all', g.get('count'))}, visible {g.get('visible')!r}, "
          f"devices {[x.get('index') for x in g.get('devices', [])]}")
PY
done 2>&1 | tee "$OUT/summary.txt"
