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
import sys
import time

import runlayout as layout   # beside this file in lib/: the run folder's names, written once
from nodeio import write_file

_last_time = None
_last_record: dict | None = None
_first_at: float | None = None
_first_step: int | None = None
_phases: dict = {}   # "checkpoint_s", "eval_s", "data_s": seconds aside from training so far (phase())
PHASES = ("checkpoint", "eval", "data")
_script_reports = False   # the program called report() itself
_phases_by: str | None = None   # who marks the phases where the script does not (lib/framework_phases.py)


def watching(names, by: str) -> None:
    """The phases `names` are marked for this rank by `by` (a trainer nodectl wrapped): they start at 0 s, so the
    ledger knows they are seen, and the records say who marks them."""
    global _phases_by
    for name in names:
        _phases.setdefault(f"{name}_s", 0.0)
    _phases_by = by


def reported_by_script() -> bool:
    return _script_reports


def phase(name: str, seconds: float) -> None:
    """Mark time this rank spent aside from training, for nodectl's goodput ledger: `name` is "checkpoint",
    "eval" or "data" (waiting for batches), `seconds` how long it took. One call per phase:

        began = time.time(); save(...); phase("checkpoint", time.time() - began)

    Summed into every later heartbeat (as checkpoint_s, eval_s, data_s). A name or duration that is not one is
    said on stderr and ignored: the training goes on."""
    if name not in PHASES or isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
            or seconds != seconds or seconds in (float("inf"), float("-inf")) or seconds < 0:
        print(f"nodectl_metrics.phase({name!r}, {seconds!r}): expected one of {', '.join(PHASES)} and a number of "
              f"seconds >= 0; ignored", file=sys.stderr, flush=True)
        return
    key = f"{name}_s"
    _phases[key] = _phases.get(key, 0.0) + float(seconds)
    if _last_record is not None:
        _write(dict(_last_record, **_phases), heartbeat_only=True)


def report(step: int, _by: str | None = None, **values: float) -> None:
    global _last_time, _last_record, _script_reports
    run_dir, rank = os.environ.get("NODECTL_RUN_DIR"), os.environ.get("RANK")
    if not run_dir or rank is None:
        return
    if _by is None:
        _script_reports = True
    now = time.time()
    global _first_at, _first_step
    if _first_at is None:   # the first step's report: where start-up ends, and the step it began at (the ledger)
        _first_at, _first_step = now, int(step)
    record = {"step": int(step), "time": now, **{k: v for k, v in values.items() if isinstance(v, (int, float))},
              **_phases, "first_step_at": _first_at, "first_step": _first_step,
              **({"phases_by": _phases_by} if _phases_by else {})}
    if "tokens" in record and _last_time is not None and now > _last_time:
        record["tokens_per_s"] = record["tokens"] / (now - _last_time)
    _last_time, _last_record = now, record
    _write(record)


def _write(record: dict, heartbeat_only: bool = False) -> None:
    run_dir, rank = os.environ.get("NODECTL_RUN_DIR"), os.environ.get("RANK")
    if not run_dir or rank is None:
        return
    heartbeat = os.path.join(run_dir, layout.heartbeat(rank))
    try:
        write_file(heartbeat, json.dumps(record))
        if heartbeat_only:
            return
        path = os.environ.get("NODECTL_METRICS") or os.path.join(run_dir, layout.rank_metrics(rank))
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
    except OSError:  # a full disk must not stop the training that reports
        pass
