#!/usr/bin/env bash
# nodectl launch script for run 20260101-000000-abcd, node 0 of 2 (node0).
# Rendered by nodectl 0.1.0. Started by runctl.py in a session of its own; every value below is quoted.
set -uo pipefail
RUN_DIR="$HOME"/nodectl/runs/20260101-000000-abcd
record_exit() {
  local code=$?
  # what is left reparented to this script (a subreaper: runctl.py) escaped its rank's process group: end it
  command -v pkill >/dev/null && pkill -TERM -P $$ 2>/dev/null
  printf '{"code": %d, "time": %s}\n' "$code" "$(date +%s.%N)" > "$RUN_DIR/state/launcher.exit.tmp"
  mv "$RUN_DIR/state/launcher.exit.tmp" "$RUN_DIR/state/launcher.exit"
}
trap record_exit EXIT
cd "$RUN_DIR" || exit 97
set -a
# shellcheck disable=SC1091
. "$RUN_DIR/env.sh"   # mode 0600: secrets stay off every command line
set +a
cd "$RUN_DIR/code" || exit 97
/opt/venv/bin/python3 -m torch.distributed.run \
  --nnodes=2 \
  --node-rank=0 \
  --nproc-per-node=8 \
  --master-addr=10.0.1.11 \
  --master-port=29500 \
  --max-restarts=0 \
  --monitor-interval=0.5 \
  --log-dir="$RUN_DIR/torchelastic" \
  "$RUN_DIR/lib/rankexec.py" train.py --lr 3e-4
