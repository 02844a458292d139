#!/usr/bin/env bash
# Issue 39's scaling figures on one 4-GPU machine (nvidia-h200-x4), one phase per call (each under 10 minutes):
#     bash bench/trainer/gpu_scaling.sh qwen-a   # Qwen3-30B-A3B: the plain script's best on 1 GPU, nodectl 1x1 and 1x4
#     bash bench/trainer/gpu_scaling.sh qwen-b   # Qwen3-30B-A3B: nodectl 1x2 and 2x2 (auto)
#     bash bench/trainer/gpu_scaling.sh qwen-ep  # Qwen3-30B-A3B 2x2: auto (replicate) and node-local expert, side by side
#                                        # (EP_SHAPE=1x2 for one node of 2 GPUs, on nvidia-h200-x2)
#     bash bench/trainer/gpu_scaling.sh qwen-ep16  # issue 71: Qwen3-30B-A3B cut to 16 layers on one node of 2 GPUs
#                                          # (nvidia-h100-x2 or -h200-x2): replicate, the expert layout with its copy
#                                          # count read on the host, with its exchange in the compiled graph
#                                          # (model.expert_exchange: graph), replicate again (A B C A)
#     bash bench/trainer/gpu_scaling.sh glm      # the whole GLM-4.5-Air: 1x4 and 2x2 (auto), bytes against fsdp's
#     bash bench/trainer/gpu_scaling.sh glm-mb2  # GLM-4.5-Air 1x4 at micro-batch 2, half the layers checkpointed
#     bash bench/trainer/gpu_scaling.sh dense    # 8B dense: 1x1, 2x1 (auto) and 2x1 with the base sharded (fsdp)
#     bash bench/trainer/gpu_scaling.sh qwen-auto  # Qwen3-30B-A3B on 1 GPU, 4 rows a step: the hand-picked split (micro-batch
#                                          # 2, 10% checkpointed) and micro_batch_size / activation_checkpointing auto
#     bash bench/trainer/gpu_scaling.sh glm-auto   # GLM-4.5-Air on 1x4: everything auto (layout, micro-batch,
#                                          # checkpointing), then fsdp with micro-batch 2, half checkpointed
#     bash bench/trainer/gpu_scaling.sh qwen-fp8   # Qwen3-30B-A3B on 1 GPU, auto's split: the routed experts' frozen base in
#                                          # bf16 and in FP8 (model.fp8_experts), 30 steps' losses side by side
#     bash bench/trainer/gpu_scaling.sh glm-2gpu   # GLM-4.5-Air's shape, 32 of its 46 layers, 1x2 (nvidia-h200-x2): the
#                                          # 2026-11-27 command (auto = fsdp, micro-batch 2, all checkpointed),
#                                          # the expert layout with auto's split, and the same with FP8 experts
#     bash bench/trainer/gpu_scaling.sh qwen-lora  # Qwen3-30B-A3B on 1 GPU, FP8 experts, auto's split: the experts' adapters
#                                          # on torch's grouped GEMMs, then in Triton (model.expert_lora_kernel)
#     OLD=/tmp/old ROUND=1 bash bench/trainer/gpu_scaling.sh combine-ab   # Qwen3-30B-A3B, FP8 experts, 1 GPU: the tree in
#                                          # OLD (`git archive --prefix=old/ COMMIT | tar -x -C /tmp`), then this one
# Every nodectl run goes through `nodectl launch` on local "nodes" (each its own CUDA_VISIBLE_DEVICES); random bf16
# weights (model.init: random), rows of 4096 tokens, LoRA r 16 on attention and routed experts. WORK (default
# /tmp/w) keeps the written model configs between calls on a warm machine. Figures: $WORK/<phase>.json.
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
WORK=${WORK:-/tmp/w}
PHASE=${1:?phase: qwen-a, qwen-b, qwen-ep, qwen-ep16, glm, glm-mb2, dense, qwen-auto, glm-auto, qwen-fp8, glm-2gpu, qwen-lora or combine-ab}
Q=train.micro_batch_size=2,model.activation_checkpointing=0.1,model.compile=true
G=train.micro_batch_size=1,model.activation_checkpointing=true,model.compile=true
AUTO=train.micro_batch_size=auto,train.batch_size=4,model.activation_checkpointing=auto,model.compile=true
case "$PHASE" in
  qwen-a)
    python3 bench/moe/gpu_moe_speed.py --work "$WORK/q" --shape qwen3-30b-a3b --steps 14 --skip 5 --ref-steps 8 \
      --ref-batch 8 --examples 240 --launch "q1x1:1x1:$Q" --launch "q1x4:1x4:$Q" --base q1x1 \
      --out "$WORK/qwen-a.json" ;;
  qwen-b)
    python3 bench/moe/gpu_moe_speed.py --work "$WORK/q" --shape qwen3-30b-a3b --steps 14 --skip 5 --no-ref \
      --examples 240 --launch "q1x2:1x2:$Q" --launch "q2x2:2x2:$Q" --base q1x2 --out "$WORK/qwen-b.json" ;;
  qwen-ep)   # experts split inside each node (all_to_all inside the node), the rest hsdp; auto's choice beside it
    python3 bench/moe/gpu_moe_speed.py --work "$WORK/q" --shape qwen3-30b-a3b --steps 14 --skip 5 --no-ref \
      --examples 240 --launch "q${EP_SHAPE:-2x2}:${EP_SHAPE:-2x2}:$Q" \
      --launch "q${EP_SHAPE:-2x2}-expert:${EP_SHAPE:-2x2}:$Q,model.parallelism=expert" --base "q${EP_SHAPE:-2x2}" \
      --out "$WORK/qwen-ep.json" ;;
  qwen-ep16)
    python3 bench/moe/gpu_moe_speed.py --work "$WORK/q16" --shape qwen3-30b-a3b --layers 16 --steps 14 --skip 5 \
      --no-ref --examples 240 --launch "r1x2:1x2:$Q,model.parallelism=replicate" \
      --launch "e1x2-host:1x2:$Q,model.parallelism=expert" \
      --launch "e1x2-graph:1x2:$Q,model.parallelism=expert,model.expert_exchange=graph" \
      --launch "r1x2-again:1x2:$Q,model.parallelism=replicate" --base r1x2 --out "$WORK/qwen-ep16.json" ;;
  glm)
    python3 bench/moe/gpu_moe_speed.py --work "$WORK/g" --shape glm-4.5-air --steps 8 --skip 3 --no-ref \
      --examples 60 --launch "g1x4:1x4:$G" --launch "g2x2:2x2:$G" --base g1x4 --out "$WORK/glm.json" ;;
  glm-mb2)   # 1x4 with the memory the shards leave: micro-batch 2, half the layers checkpointed
    python3 bench/moe/gpu_moe_speed.py --work "$WORK/g" --shape glm-4.5-air --steps 8 --skip 3 --no-ref \
      --examples 60 --launch "g1x4-mb2:1x4:train.micro_batch_size=2,model.activation_checkpointing=0.5,model.compile=true" \
      --base g1x4-mb2 --out "$WORK/glm-mb2.json" ;;
  dense)
    python3 bench/trainer/gpu_train.py --work "$WORK/d" --random-weights --parts 1x1,2x1,2x1-fsdp --steps 16 --skip 5 \
      --checkpoint-every 0 --out "$WORK/dense.json" ;;
  qwen-auto)
    python3 bench/moe/gpu_moe_speed.py --work "$WORK/q" --shape qwen3-30b-a3b --steps 10 --skip 4 --no-ref \
      --examples 240 --launch "q-hand:1x1:train.micro_batch_size=2,train.grad_accum=2,model.activation_checkpointing=0.1,model.compile=true" \
      --launch "q-auto:1x1:$AUTO" --base q-hand --out "$WORK/qwen-auto.json" ;;
  glm-auto)  # auto (the expert layout since issue 54) first, then the 2026-11-27 best by hand: fsdp, mb 2, half
    python3 bench/moe/gpu_moe_speed.py --work "$WORK/g" --shape glm-4.5-air --steps 6 --skip 2 --no-ref \
      --examples 60 --launch "g-auto:1x4:$AUTO" \
      --launch "g-fsdp:1x4:train.micro_batch_size=2,train.grad_accum=2,model.activation_checkpointing=0.5,model.compile=true,model.parallelism=fsdp" \
      --base g-fsdp --out "$WORK/glm-auto.json" ;;
  qwen-fp8)
    python3 bench/moe/gpu_moe_speed.py --work "$WORK/q" --shape qwen3-30b-a3b --steps 30 --skip 5 --no-ref \
      --examples 240 --launch "q-bf16:1x1:$AUTO" --launch "q-fp8:1x1:$AUTO,model.fp8_experts=true" --base q-bf16 \
      --compare q-bf16,q-fp8 --out "$WORK/qwen-fp8.json" ;;
  glm-2gpu)
    A2=train.micro_batch_size=auto,train.batch_size=2,model.activation_checkpointing=auto,model.compile=true
    python3 bench/moe/gpu_moe_speed.py --work "$WORK/g" --shape glm-4.5-air --layers 32 --no-ref --steps 10 --skip 4 \
      --examples 100 --launch "g1x2:1x2:train.micro_batch_size=2,model.activation_checkpointing=true,model.compile=true" \
      --launch "g1x2-expert-auto:1x2:$A2,model.parallelism=expert" \
      --launch "g1x2-expert-auto-fp8:1x2:$A2,model.parallelism=expert,model.fp8_experts=true" --base g1x2 \
      --compare g1x2-expert-auto,g1x2-expert-auto-fp8 --out "$WORK/glm-2gpu.json" ;;
  qwen-lora)
    F="$AUTO,model.fp8_experts=true"
    python3 bench/moe/gpu_moe_speed.py --work "$WORK/q" --shape qwen3-30b-a3b --steps 14 --skip 5 --no-ref \
      --examples 240 --launch "q-torch:1x1:$F,model.expert_lora_kernel=torch" \
      --launch "q-triton:1x1:$F,model.expert_lora_kernel=triton" --base q-torch --compare q-torch,q-triton \
      --out "$WORK/qwen-lora.json" ;;
  combine-ab)   # Qwen3-30B-A3B with FP8 experts on 1 GPU, auto's split, 20 steps: the tree in $OLD (an earlier
                # commit's `git archive`) first, then this one, in one call; run twice for the second pair
    F="$AUTO,model.fp8_experts=true"
    for tree in "${OLD:?OLD: an earlier tree to compare with}" "$PWD"; do
      tag=$([ "$tree" = "$PWD" ] && echo now || echo before)
      (cd "$tree" && PYTHONPATH="$tree" python3 bench/moe/gpu_moe_speed.py --work "$WORK/q" --shape qwen3-30b-a3b \
        --steps 20 --skip 5 --no-ref --examples 240 --launch "q-fp8-$tag-${ROUND:-1}:1x1:$F" \
        --out "$WORK/combine-ab-$tag-${ROUND:-1}.json")
    done ;;
  *) echo "unknown phase $PHASE" >&2; exit 2 ;;
esac
