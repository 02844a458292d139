#!/usr/bin/env bash
# nodectl launch script for run 20260101-000000-abcd, node 1 of 2 (node1).
# Rendered by nodectl 0.1.0. Started by runctl in a session of its own; every value below is quoted.
set -uo pipefail
RUN_DIR="$HOME"/nodectl/runs/20260101-000000-abcd
# Every process still below this script: runctl made it a subreaper, so the run's orphans (a rank's child
# that double-forked, called setsid and shed its environment) come here, and so do their own children.
# Called as $(run_tree "$BASHPID"): the command substitution's own shell, and its ps and awk, are left out.
run_tree() {
  ps -e -o pid=,ppid= | awk -v root=$$ -v self="$1" '{ parent[$1] = $2 } END {
    below[root] = 1; grew = 1
    while (grew) { grew = 0; for (p in parent) if (!(p in below) && (parent[p] in below) && p != self) { below[p] = 1; grew = 1 } }
    delete below[root]; for (p in below) print p }'
}
record_exit() {
  local code=$? left
  # what is left when the run ends escaped its rank: SIGTERM, then SIGKILL what ignores it
  left=$(run_tree "$BASHPID")
  if [ -n "$left" ]; then
    kill -TERM $left 2>/dev/null; sleep 2
    left=$(run_tree "$BASHPID"); [ -n "$left" ] && kill -KILL $left 2>/dev/null
  fi
  # under a name nobody could plant a link at, then renamed over whatever is there (-T: never into a folder)
  local record
  record=$(mktemp "$RUN_DIR/state/.launcher.exit.XXXXXX") || return
  printf '{"code": %d, "time": %s}\n' "$code" "$(date +%s.%N)" > "$record"
  mv -fT "$record" "$RUN_DIR/state/launcher.exit"
}
trap record_exit EXIT
# `nodectl stop` signals every process of the run itself and SIGKILLs after its grace period: a SIGTERM must not end
# this script (whose exit trap would SIGKILL the ranks 2 s later, cutting a checkpoint short); it waits for torchrun.
trap : TERM
cd "$RUN_DIR" || exit 97
set -a
# shellcheck disable=SC1091
. "$RUN_DIR/env.sh"   # mode 0600: secrets stay off every command line
set +a
cd "$RUN_DIR/code" || exit 97
/opt/venv/bin/python3 "$RUN_DIR/lib/elastic_agent.py" \
  --nnodes=2 \
  --node-rank=1 \
  --nproc-per-node=8 \
  --master-addr=10.0.1.11 \
  --master-port=29500 \
  --max-restarts=0 \
  --monitor-interval=0.5 \
  --log-dir="$RUN_DIR/torchelastic" \
  "$RUN_DIR/lib/rankexec.py" train.py --lr 3e-4
