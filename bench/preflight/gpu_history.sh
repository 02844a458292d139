#!/usr/bin/env bash
# On the GPU machine (local transport, one "node" with every GPU): preflight's history (issue 53). Three healthy
# default-tier preflights record each GPU's figures; a fourth with GPU 0 saturated by another process is judged
# against that past; then the recorded baseline edited 30% higher and a healthy run judged against it; then a
# healthy re-run with the true history. Output in $OUT (summary.txt and each JSON report).
# Needs nodectl's pure-Python dependencies: pip install --no-index --find-links .whl (bench/README-like: carry .whl).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$REPO/gpu-history}; mkdir -p "$OUT"
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} COLUMNS=200
work=$(mktemp -d); cd "$work"
export NODECTL_STATE_DIR=$work/state
printf 'nodes:\n  - {host: localhost, name: node0, transport: local, device: cuda, python: python3, workdir: %s/n0}\n' \
  "$work" > hosts.yaml
show() {  # the history's verdicts and line, and the GPU job's figures
  python3 - "$1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("  " + (d.get("history") or "(no history line)"))
for r in d["results"]:
    if r["check"] in ("history", "gpu perf", "gpu load") and r["verdict"] != "pass" or r["check"] == "history":
        print(f"  {r['check']:10} {r['node']:8} {r['verdict']:5} {r['detail'][:400]}")
for name, facts in (d.get("gpu_jobs") or {}).items():
    for g in facts.get("devices", []):
        print(f"  job GPU{g.get('index')}: GEMM {g.get('gemm_tflops')} TFLOP/s, HBM {g.get('hbm_gbps')} GB/s")
PY
}
run() {  # label, output file
  local started=$EPOCHREALTIME
  python3 -m nodectl -i hosts.yaml --json preflight > "$2" 2> "$2.err"; local code=$?
  awk -v a="$started" -v b="$EPOCHREALTIME" -v l="$1" -v c="$code" 'BEGIN {printf "%s: exit %s, %.1f s\n", l, c, b - a}'
  show "$2"
}
{
nvidia-smi --query-gpu=index,name --format=csv,noheader
for i in 1 2 3; do run "healthy preflight $i (recording)" "healthy$i.json"; done
echo "== GPU 0 saturated by another process during the GPU job"
CUDA_VISIBLE_DEVICES=0 python3 -c "
import torch, time
a = torch.randn(16384, 16384, dtype=torch.bfloat16, device='cuda'); b = torch.randn_like(a)
end = time.time() + 200
while time.time() < end:
    for _ in range(20): torch.mm(a, b)
    torch.cuda.synchronize()
" &
hog=$!; sleep 10
run "preflight, GPU 0 busy" busy.json
kill $hog; wait $hog 2>/dev/null
echo "== the recorded baseline edited 30% higher, then a healthy preflight"
cp "$NODECTL_STATE_DIR/preflight-history.jsonl" true-history.jsonl
python3 - "$NODECTL_STATE_DIR/preflight-history.jsonl" <<'PY'
import json, sys
path = sys.argv[1]
entries = [json.loads(l) for l in open(path)][:3]   # the three healthy ones
for e in entries:
    for f in e["figures"]:
        if f["metric"] == "gemm_tflops":
            f["value"] = round(f["value"] * 1.3, 1)
open(path, "w").write("".join(json.dumps(e) + "\n" for e in entries))
PY
run "healthy preflight against the edited baseline" edited.json
echo "== the true history back, a healthy re-run"
head -3 true-history.jsonl > "$NODECTL_STATE_DIR/preflight-history.jsonl"
run "healthy re-run" rerun.json
python3 -m nodectl preflight --history node0 | tail -8
} 2>&1 | tee "$OUT/summary.txt"
cp ./*.json "$OUT/" 2>/dev/null
