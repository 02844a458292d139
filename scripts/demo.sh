#!/usr/bin/env bash
# The main job on a fresh machine: set up, then run the built-in FSDP+LoRA demo on two local "nodes".
set -euo pipefail
cd "$(dirname "$0")/.."
NODECTL_SKIP_APT=1 bash scripts/setup.sh
mkdir -p demo-run && cd demo-run
exec ../.venv/bin/nodectl launch --nodes 2 --gpus 1 "$@"
