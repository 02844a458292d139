#!/usr/bin/env bash
# On the GPU machine (local transport, one "node" with every GPU): preflight's GPU health figures beside nvidia-smi
# and a plain torch measurement (bench/preflight/gpu_health_ref.py); the wall time of --quick and of the default tier; and a
# GPU made slow on purpose (a second process saturating it with matmuls) named by preflight. Output in $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$REPO/gpu-health}; mkdir -p "$OUT"
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} COLUMNS=200
work=$(mktemp -d); cd "$work"
printf 'nodes:\n  - {host: localhost, name: node0, transport: local, device: cuda, python: python3, workdir: %s/n0}\n' \
  "$work" > hosts.yaml
show() {  # the health verdicts of a preflight JSON report
  python3 - "$1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
keep = ("gpu perf", "gpu load", "gpu idle", "p2p", "pcie link", "thermal", "mig", "fabric manager", "nvlink errors",
        "xid", "collective")
for r in d["results"]:
    if r["check"] in keep or r["verdict"] in ("fail", "warn"):
        print(f"  {r['check']:15} {r['verdict']:5} {r['detail'][:300]}")
for name, facts in (d.get("gpu_jobs") or {}).items():
    for g in facts.get("devices", []):
        print(f"  job GPU{g.get('index')}: GEMM {g.get('gemm_tflops')} TFLOP/s, HBM {g.get('hbm_gbps')} GB/s, "
              f"H2D {g.get('h2d_gbps')} D2H {g.get('d2h_gbps')} GB/s, PCIe gen {g.get('pcie_gen')} x{g.get('pcie_width')}, "
              f"{g.get('temperature_c')} C, events {g.get('clock_events')}")
PY
}
timed() {  # label, output file, then the command: prints the wall seconds
  local started=$EPOCHREALTIME; "${@:3}" > "$2" 2> "$2.err"; local code=$?
  awk -v a="$started" -v b="$EPOCHREALTIME" -v l="$1" -v c="$code" 'BEGIN {printf "%s: exit %s, %.1f s\n", l, c, b - a}'
}
{
echo "== nvidia-smi"
nvidia-smi --query-gpu=index,name,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max,temperature.gpu,mig.mode.current,compute_mode,clocks.max.sm --format=csv
echo "== plain torch at its best settings (bench/preflight/gpu_health_ref.py, CUDA events, each GPU alone)"
python3 "$REPO/bench/preflight/gpu_health_ref.py"
echo "== tiers"
for i in 1 2; do timed "preflight --quick" quick.json python3 -m nodectl -i hosts.yaml --json preflight --quick; done
for i in 1 2; do timed "preflight (default tier)" default.json python3 -m nodectl -i hosts.yaml --json preflight; done
show default.json
echo "== GPU 1 saturated by another process"
CUDA_VISIBLE_DEVICES=1 python3 -c "
import torch, time
a = torch.randn(16384, 16384, dtype=torch.bfloat16, device='cuda'); b = torch.randn_like(a)
end = time.time() + 240
while time.time() < end:
    for _ in range(20): torch.mm(a, b)
    torch.cuda.synchronize()
" &
hog=$!; sleep 10
timed "preflight (default tier), GPU 1 busy" slowed.json python3 -m nodectl -i hosts.yaml --json preflight
kill $hog; wait $hog 2>/dev/null
show slowed.json
tail -3 slowed.json.err
} 2>&1 | tee "$OUT/summary.txt"
cp ./*.json "$OUT/" 2>/dev/null
