#!/usr/bin/env bash
# On the GPU machine (2+ GPUs, no sshd: local transport, two local "nodes" each with its own GPU):
# the demo and a ~1B Llama through `nodectl launch` with NCCL. Figures land in $OUT (or ./gpu-proof).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$REPO/gpu-proof}; mkdir -p "$OUT"
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
NODECTL="python3 -m nodectl"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpus.txt"
python3 -c "import torch,transformers,peft;print('torch',torch.__version__,'nccl',torch.cuda.nccl.version(),'transformers',transformers.__version__,'peft',peft.__version__)" | tee -a "$OUT/gpus.txt"
nvidia-smi topo -m | tee -a "$OUT/gpus.txt"

work=$(mktemp -d); cd "$work"
echo "== demo, 2 local nodes x 1 GPU, NCCL"
$NODECTL launch --nodes 2 --gpus 1 --skip-preflight 2>&1 | tail -25 | tee "$OUT/demo.log"
$NODECTL collect >/dev/null 2>&1; cp runs/*/nodes/local0/output/metrics.jsonl "$OUT/demo-metrics.jsonl" 2>/dev/null
grep -hE "Error|error:" runs/*/nodes/*/logs/rank*.log | grep -v "^\[rank.\]: #" | head -20 | tee -a "$OUT/demo.log"

echo "== 1B Llama (hidden 2048, 16 layers, 32/8 heads, ffn 8192, vocab 128256), seq 2048"
mkdir -p "$work/models" "$work/proj1b"; cd "$work/proj1b"
python3 "$REPO/bench/common/make_llama.py" "$work/models/llama1b" --examples 256 --chars 2100 | tee -a "$OUT/llama1b.log"
cat > recipe1b.yaml <<YAML
model: {path: $work/models/llama1b, activation_checkpointing: ${AC:-false}}
lora: {r: 16, alpha: 32}
data: {path: $work/models/llama1b/train.jsonl, max_length: 2048}
train: {steps: ${STEPS:-30}, micro_batch_size: ${MBS:-4}, lr: 0.0002, warmup_steps: 3, log_every: 5}
YAML
$NODECTL launch --nodes 2 --gpus 1 --skip-preflight --config recipe1b.yaml 2>&1 | tail -20 | tee -a "$OUT/llama1b.log"
$NODECTL collect >/dev/null 2>&1; cp runs/*/nodes/local0/output/metrics.jsonl "$OUT/llama1b-metrics.jsonl" 2>/dev/null
grep -hE "Error|error:" runs/*/nodes/*/logs/rank*.log | grep -v "^\[rank.\]: #" | head -20 | tee -a "$OUT/llama1b.log"

echo "== 1B: checkpoints, eval, crash inside the step-20 checkpoint, then nodectl launch --resume"
cat > recipe1b-resume.yaml <<YAML
model: {path: $work/models/llama1b, activation_checkpointing: false}
lora: {r: 16, alpha: 32}
data: {path: $work/models/llama1b/train.jsonl, max_length: 2048, eval_holdout: 32, eval_samples: 16}
train: {steps: 30, micro_batch_size: 4, lr: 0.0002, warmup_steps: 3, log_every: 5, checkpoint_every: 10, eval_every: 10}
YAML
NODECTL_TEST_CRASH_IN_CHECKPOINT=20 $NODECTL launch --nodes 2 --gpus 1 --skip-preflight --config recipe1b-resume.yaml 2>&1 | grep -E "checkpoint|failed|eval" | head -6 | tee -a "$OUT/resume.log"
run=$(ls runs | grep -v '^\.' | tail -1)
$NODECTL launch --resume "$run" --skip-preflight 2>&1 | grep -E "resuming|eval|checkpoint|adapter|succeeded|failed|Error" | tee -a "$OUT/resume.log"
$NODECTL collect --run "$run" >/dev/null 2>&1; $NODECTL report "$run" 2>&1 | tee -a "$OUT/resume.log"
cp runs/"$run"/report/gpu_utilisation.png "$OUT/" 2>/dev/null; cp runs/"$run"/report/loss.png "$OUT/resume-loss.png" 2>/dev/null
