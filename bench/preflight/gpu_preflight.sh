#!/usr/bin/env bash
# On the GPU machine: nodectl preflight --full (1 node x 2 GPUs, and 2 local "nodes" x 1 GPU) side by side with
# NVIDIA's nccl-tests all_reduce_perf built from a snapshot in ./.nccl-tests (not part of this repository).
# Prints busbw per size and the ratio nodectl/all_reduce_perf. Figures land in $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$REPO/gpu-proof}; mkdir -p "$OUT"
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
NH=$(python3 -c "import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])")
mkdir -p /tmp/nccl-lib && ln -sf "$NH"/lib/libnccl.so.2 /tmp/nccl-lib/libnccl.so
export LD_LIBRARY_PATH=$NH/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
( cd "$REPO/.nccl-tests" && make -s -j16 MPI=0 CUDA_HOME=/usr/local/cuda NCCL_HOME="$NH" \
    NVLDFLAGS="-L/tmp/nccl-lib -lnccl" NVCC_GENCODE="-gencode=arch=compute_90,code=sm_90" src.build >/dev/null 2>&1 ) \
  || ( cd "$REPO/.nccl-tests" && make -j16 MPI=0 CUDA_HOME=/usr/local/cuda NCCL_HOME="$NH" \
    NVLDFLAGS="-L/tmp/nccl-lib -L/usr/local/cuda/lib64 -lcudart -lnccl" NVCC_GENCODE="-gencode=arch=compute_90,code=sm_90" 2>&1 | tail -15 )
PERF=$(find "$REPO/.nccl-tests/build" -name all_reduce_perf -type f | head -1)
G=${GPUS:-2}; H=$((G / 2))
echo "== nccl-tests all_reduce_perf, $G GPUs, float sum, 1 MiB .. 4 GiB"
"$PERF" -b 1M -e 4G -f 2 -g "$G" -n 20 -w 5 2>&1 | tee "$OUT/all_reduce_perf.txt" | grep -E "^ +[0-9]|Avg bus" | tail -14
work=$(mktemp -d); cd "$work"
echo "== nodectl preflight --full: 1 node x $G GPUs"
python3 -m nodectl --json preflight --full > "$OUT/preflight-1x2.json" 2> "$OUT/preflight-1x2.err"; echo "exit $?"
job=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("collective_run") or "")' "$OUT/preflight-1x2.json")
[ -n "$job" ] && python3 -m nodectl tail rank0 -n 400 --run "$job" 2>&1 | grep -E "Error|error|NCCL INFO Channel" | head -12
echo "== nodectl preflight --full: 2 local nodes x $H GPU(s)"
python3 -m nodectl --json preflight --full --nodes 2 --gpus "$H" > "$OUT/preflight-2x1.json" 2> "$OUT/preflight-2x1.err"; echo "exit $?"
python3 - "$OUT" <<'PY'
import json, re, sys
out = sys.argv[1]
ref = {}
for line in open(f"{out}/all_reduce_perf.txt"):
    f = line.split()
    if len(f) > 12 and f[0].isdigit():
        ref[int(f[0])] = float(f[11])  # in-place busbw (GB/s)
for name in ("preflight-1x2", "preflight-2x1"):
    try:
        doc = json.load(open(f"{out}/{name}.json"))
    except Exception as exc:
        print(name, "no report:", exc, open(f"{out}/{name}.err").read()[-1500:]); continue
    print(f"== {name}: passed={doc['passed']}")
    for r in doc["results"]:
        if r["check"] in ("p2p", "nvlink", "collective", "nccl transport", "gpus", "gpu idle") or r["verdict"] != "pass":
            print(f"   {r['node']:8} {r['check']:15} {r['verdict']:5} {r['detail']}")
    col = doc.get("collective") or {}
    print(f"   {'size':>8} {'nccl-tests':>11} {'nodectl':>9} {'ratio':>6}")
    for s in col.get("sizes", []):
        b = s["bytes"]; r = ref.get(b)
        print(f"   {b >> 20:>6}Mi {r if r else float('nan'):>11.1f} {s['busbw_gbs']:>9.1f} {s['busbw_gbs'] / r if r else float('nan'):>6.3f}")
PY
