"""Report your own training metrics to nodectl (`status`, `top`, `report`) from any torchrun script.

    from nodectl_metrics import report          # on the nodes' path under `nodectl launch`
    report(step=step, loss=loss.item(), tokens=tokens_this_step)

Standard library only, a few microseconds per call, and a no-op outside nodectl. Each call replaces this rank's
heartbeat ($NODECTL_RUN_DIR/heartbeat/rank<R>.json, which `status` and `top` read and which marks a rank as
alive) and appends one line to $NODECTL_METRICS (metrics/rank<R>.jsonl in the run folder, which `collect` brings
back for `report`). `tokens` is the count since the previous call; tokens_per_s is derived from it. Any other
numbers given by name are kept as they are. Without the import, the same by hand:

    json.dump({"step": step, "time": time.time(), "loss": loss}, open(heartbeat_path, "w"))
"""
from __future__ import annotations

import json
import os
import time

import runlayout as layout   # beside this file in lib/: the run folder's names, written once
from nodeio import write_file

_last_time = None


def report(step: int, **values: float) -> None:
    global _last_time
    run_dir, rank = os.environ.get("NODECTL_RUN_DIR"), os.environ.get("RANK")
    if not run_dir or rank is None:
        return
    now = time.time()
    record = {"step": int(step), "time": now, **{k: v for k, v in values.items() if isinstance(v, (int, float))}}
    if "tokens" in record and _last_time is not None and now > _last_time:
        record["tokens_per_s"] = record["tokens"] / (now - _last_time)
    _last_time = now
    heartbeat = os.path.join(run_dir, layout.heartbeat(rank))
    try:
        write_file(heartbeat, json.dumps(record))
        path = os.environ.get("NODECTL_METRICS") or os.path.join(run_dir, layout.rank_metrics(rank))
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
    except OSError:  # a full disk must not stop the training that reports
        pass
