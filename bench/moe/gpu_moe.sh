#!/usr/bin/env bash
# GPU proof of the trainer on Mixture-of-Experts models (issue 15, part 3), on one node of 2+ GPUs:
#  1. a mid-size Qwen3-MoE shape (hidden 2048, 16 layers, 64 experts, top-8; ~5B parameters), random weights
#     (model.init: random), LoRA on attention and on the routed experts' fused weights, FSDP2 over 2 GPUs, packed
#     rows of 2048 tokens: loss, tokens/s/GPU, MFU over the active parameters, peak memory;
#  2. a GLM-4-MoE checkpoint (shared experts, a dense first layer) saved as the Hub has it, loaded sliced (each
#     rank reads only its experts), trained, exported merged and in vLLM's layout.
#     bash bench/moe/gpu_moe.sh            (writes figures to $OUT when set)
# transformers >= 5 builds fused experts; an older one on the machine is upgraded in a throwaway venv from the
# wheels in .wheels-moe (pip download; see docs/PERFORMANCE.md).
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-$(mktemp -d)}
WORK=$(mktemp -d)
export NODECTL_DEMO_CACHE=$WORK/demo
PY=python
if ! $PY -c 'import sys, transformers; sys.exit(int(transformers.__version__.split(".")[0]) < 5)'; then
  $PY -m venv --system-site-packages "$WORK/venv"
  "$WORK/venv/bin/pip" install -q --no-index --find-links .wheels-moe transformers==5.23.0 peft==0.21.2
  PY=$WORK/venv/bin/python
fi
$PY -c 'import torch, transformers, peft; print("torch", torch.__version__, "transformers", transformers.__version__,
"peft", peft.__version__, "gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0))' | tee "$OUT/versions.txt"
GPUS=$($PY -c 'import torch; print(torch.cuda.device_count())')

run() {  # name, then trainer --set overrides
  local name=$1; shift
  local sets=()
  for s in "$@"; do sets+=(--set "$s"); done
  local started=$SECONDS
  $PY -m torch.distributed.run \
    --nproc-per-node "$GPUS" --master-port 29517 -m trainer --set "train.output_dir=$WORK/$name" "${sets[@]}" \
    2>&1 | grep -v -i "warn" | tee "$OUT/$name.log"
  echo "$name: torchrun wall $((SECONDS - started)) s" | tee -a "$OUT/$name.log"
}

$PY bench/common/make_moe.py "$WORK/m-mid" --layout qwen3_moe --hidden 2048 --layers 16 --experts 64 --top-k 8 \
  --expert-intermediate 768 --heads 16 --no-weights
run mid "model.path=$WORK/m-mid" model.init=random "data.path=$WORK/m-mid/train.jsonl" data.packing=true \
  data.max_length=2048 train.micro_batch_size=4 train.steps=30 train.log_every=5 train.lr=1e-3

$PY bench/common/make_moe.py "$WORK/m-glm" --layout glm4_moe --hidden 1024 --layers 8 --experts 32 --top-k 4 \
  --expert-intermediate 512 --heads 8 --dtype bfloat16
run glm "model.path=$WORK/m-glm" "data.path=$WORK/m-glm/train.jsonl" data.packing=true data.max_length=1024 \
  train.micro_batch_size=4 train.steps=30 train.log_every=5 train.lr=1e-3 train.export=merged,vllm
du -sh "$WORK/m-glm/model.safetensors" "$WORK/glm/merged" "$WORK/glm/adapter-vllm" 2>/dev/null || true
$PY - "$WORK" <<'EOF' | tee "$OUT/reload.txt"
# The merged export, loaded by transformers on one GPU, against the base: the adapter changed the model.
import sys, torch
from transformers import AutoModelForCausalLM
work = sys.argv[1]
ids = torch.arange(4, 40).reshape(1, -1).cuda()
base = AutoModelForCausalLM.from_pretrained(f"{work}/m-glm", dtype=torch.bfloat16).cuda().eval()
merged = AutoModelForCausalLM.from_pretrained(f"{work}/glm/merged", dtype=torch.bfloat16).cuda().eval()
with torch.no_grad():
    a, b = base(input_ids=ids).logits.float(), merged(input_ids=ids).logits.float()
print(f"merged model loads: max |logit difference| to the base {(a - b).abs().max().item():.3f}")
EOF
