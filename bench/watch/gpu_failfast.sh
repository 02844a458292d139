#!/usr/bin/env bash
# On the GPU machine (4 GPUs): an NCCL job on 2 local "nodes" x 2 GPUs, one rank killed with SIGKILL; measures the
# time until every process of the run is gone and checks the GPUs are free (nvidia-smi, then preflight --quick).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
REPO=$(cd "$(dirname "$0")/../.." && pwd)
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
work=$(mktemp -d); cd "$work"
cat > ring.py <<'PY'
import os, time, torch, torch.distributed as dist
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
x = torch.ones(64 << 20, device="cuda")
step = 0
while True:
    dist.all_reduce(x); torch.cuda.synchronize(); step += 1
    if step % 50 == 0:
        print("step", step, flush=True)
PY
python3 -m nodectl launch --nodes 2 --gpus 2 --skip-preflight --grace 10 -- ring.py > launch.out 2> launch.err &
ctl=$!
sleep 2; run=$(ls -t runs | grep -v '^\.' | head -1); node1=~/.nodectl/local/runs/$run/local1
for i in $(seq 1 120); do grep -qs "step 100" "$node1/logs/rank3.log" && break; sleep 0.5; done
victim=$(cat "$node1/ranks/rank3.pid")
t0=$(date +%s.%N); kill -9 "$victim"
wait $ctl; code=$?
python3 -m nodectl stop --run "$run" --grace 1 >/dev/null 2>&1
t1=$(date +%s.%N)
left=$(python3 - <<'PY'
import os
n = 0
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            if b"NODECTL_RUN_ID=" in open(f"/proc/{pid}/environ", "rb").read():
                n += 1
        except OSError:
            pass
print(n)
PY
)
echo "launch exit $code; rank killed -> launch returned with the run stopped: $(python3 -c "print(round($t1-$t0,2))") s; run processes left: $left"
tail -4 launch.err
nvidia-smi --query-compute-apps=pid,used_memory --format=csv
python3 -m nodectl preflight --quick --nodes 2 --gpus 2 2>&1 | grep -E "gpu idle|preflight|FAIL"
