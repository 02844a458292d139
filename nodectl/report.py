"""`nodectl report`: PNG plots and a short summary from a collected run folder (runs/<id>/nodes/<node>/)."""
from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

from nodectl.errors import RunFailed, UsageError


TIMING_NAME = re.compile(r"^rank(\d{1,7})\.jsonl$")
STEP_LIMIT = 1 << 53


def jsonl_objects(path: Path) -> list[dict]:
    """The JSON object lines of a file ranks or nodes wrote: anything else on a line (a bare number, a list, a line
    cut by a crash, JSON nested too deep) costs that line alone."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _number(value) -> bool:
    """A value a plot can take: an int or float, finite (10**400 is not), not a bool."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return -STEP_LIMIT < value < STEP_LIMIT if isinstance(value, int) else math.isfinite(value)


def _json_object(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text(errors="replace"))
    except (OSError, ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def load_collected(run_folder: Path) -> dict:
    nodes = run_folder / "nodes"
    if not nodes.is_dir():
        raise UsageError(f"run {run_folder.name} has not been collected: run `nodectl collect --run {run_folder.name}`")
    data = {"metrics": [], "summary": None, "telemetry": {}, "timing": {}, "adapter": None}
    for node in sorted(p for p in nodes.iterdir() if p.is_dir()):
        metrics = jsonl_objects(node / "output" / "metrics.jsonl")
        if metrics:
            data["metrics"], data["metrics_node"] = metrics, node.name
            if (node / "output" / "summary.json").is_file():
                data["summary"] = _json_object(node / "output" / "summary.json")
            if (node / "output" / "adapter").exists():
                data["adapter"] = str((node / "output" / "adapter").resolve())
        for telemetry in (node / "metrics" / "telemetry.jsonl", node / "telemetry.jsonl"):   # the latter: older runs
            if telemetry.is_file():
                data["telemetry"][node.name] = jsonl_objects(telemetry)
                break
        for timing in sorted((node / "timing").glob("rank*.jsonl")) if (node / "timing").is_dir() else []:
            if match := TIMING_NAME.match(timing.name):   # a rank may name a file anything: rankX.jsonl is no rank
                data["timing"][int(match[1])] = jsonl_objects(timing)
    if not data["metrics"]:
        data["metrics"], data["custom"] = _reported(nodes), True
    data["pace"] = jsonl_objects(run_folder / "pace.jsonl")   # the attached launch's judged windows (nodectl/pace.py)
    if not data["metrics"] and not data["pace"]:
        raise RunFailed(f"run {run_folder.name}: no metrics were collected: the built-in trainer writes them, and "
                         f"your own script can with nodectl_metrics.report(step=..., loss=...) (see the README)")
    return data


def _reported(nodes: Path) -> list[dict]:
    """What a user's script reported through nodectl_metrics (metrics/rank<R>.jsonl), rank 0's view: the same
    keys as the built-in trainer's where they mean the same (tokens_per_s is per rank, so per GPU)."""
    for node in sorted(p for p in nodes.iterdir() if p.is_dir()):
        rows = jsonl_objects(node / "metrics" / "rank0.jsonl")
        if rows:
            for row in rows:
                if "tokens_per_s" in row:
                    row.setdefault("tokens_per_s_per_gpu", row["tokens_per_s"])
            return [row for row in rows if isinstance(row.get("step"), int)]
    return []


def _last_per_step(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """A resumed run logs some steps twice: the later value wins. Rows whose step is not a whole number in range or
    whose value is not a finite number are left out (rank-written: evidence, not the report's undoing)."""
    by_step = {r["step"]: r[key] for r in rows if isinstance(r.get("step"), int) and not isinstance(r["step"], bool)
               and 0 <= r["step"] < STEP_LIMIT and _number(r.get(key))}
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def render(data: dict, out: Path) -> list[Path]:
    try:
        import matplotlib
    except ImportError:
        raise UsageError("nodectl report draws its plots with matplotlib, which is not installed here: "
                         "pip install 'nodectl[report]' (or pip install matplotlib)") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []

    def figure(name: str, title: str, ylabel: str, series: list[tuple[str, list, list]], log: bool = False,
               from_zero: bool = False) -> None:
        series = [s for s in series if s[1]]
        if not series:
            return
        fig, axis = plt.subplots(figsize=(8, 4.5), dpi=100)
        for label, xs, ys in series:
            axis.plot(xs, ys, label=label, marker="." if len(xs) < 60 else None)
        axis.set_title(title)
        axis.set_xlabel("step" if name != "gpu_utilisation" else "seconds since start")
        axis.set_ylabel(ylabel)
        if log and all(y > 0 for _, _, ys in series for y in ys):
            axis.set_yscale("log")   # a loss falls over orders of magnitude; linear hides the later progress
        if from_zero:
            axis.set_ylim(bottom=0)  # throughput noise must not look like a collapse
        axis.grid(alpha=0.3, which="both")
        axis.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png")
        plt.close(fig)
        written.append(out / f"{name}.png")

    metrics = data["metrics"]
    figure("loss", "loss", "loss (log scale)", [("train", *_last_per_step(metrics, "loss")),
                                                ("eval", *_last_per_step(metrics, "eval_loss"))], log=True)
    figure("tokens_per_s", "tokens/s per GPU", "tokens/s", [("tokens/s/GPU", *_last_per_step(metrics,
                                                                                           "tokens_per_s_per_gpu"))],
           from_zero=True)
    figure("mfu", "model FLOPs utilisation", "MFU", [("MFU", *_last_per_step(metrics, "mfu"))], from_zero=True)
    figure("memory", "peak GPU memory", "GB", [("max allocated", *_last_per_step(metrics, "max_memory_gb"))],
           from_zero=True)
    figure("step_time", "step time per rank (straggler check)", "seconds",
           [(f"rank {rank}", *_last_per_step(rows, "step_time_s")) for rank, rows in sorted(data["timing"].items())])
    if data.get("custom"):
        ignored = {"step", "time", "loss", "eval_loss", "tokens", "tokens_per_s", "tokens_per_s_per_gpu"}
        keys = sorted({k for row in metrics for k, v in row.items() if k not in ignored
                       and isinstance(v, (int, float)) and not isinstance(v, bool)})
        for key in keys[:12]:
            figure(f"metric_{''.join(c if c.isalnum() or c in '_-' else '_' for c in key)}", key, key,
                   [(key, *_last_per_step(metrics, key))])
    util = []
    for node, rows in data["telemetry"].items():
        rows = [r for r in rows if _number(r.get("time")) and isinstance(r.get("gpus"), list)]
        if rows:
            start = rows[0]["time"]
            for gpu in range(min(len(rows[0]["gpus"]), 64)):
                first = rows[0]["gpus"][gpu] if isinstance(rows[0]["gpus"][gpu], dict) else {}
                points = [(r["time"] - start, r["gpus"][gpu]["util"]) for r in rows if len(r["gpus"]) > gpu
                          and isinstance(r["gpus"][gpu], dict) and _number(r["gpus"][gpu].get("util"))]
                util.append((f"{node} GPU{first.get('gpu', gpu)}", [x for x, _ in points], [y for _, y in points]))
    figure("gpu_utilisation", "GPU utilisation", "%", util, from_zero=True)
    if _pace_figure(plt, data.get("pace") or [], out / "pace.png"):
        written.append(out / "pace.png")
    if _timeline_figure(plt, data.get("goodput"), metrics, out / "timeline.png"):
        written.append(out / "timeline.png")
    return written


# the timeline's spans: (what, colour), in the order a legend lists them
SPANS = (("set-up", "tab:blue"), ("start-up", "tab:grey"), ("training", "tab:green"), ("work redone", "tab:olive"),
         ("failed, not yet noticed", "tab:red"), ("restarting", "tab:orange"))


def _timeline_figure(plt, spent: dict | None, metrics: list[dict], path: Path) -> bool:
    """The run at a glance (nodectl/goodput.py's ledger): a row per attempt, its set-up, start-up, training (the
    work done again after a restart over it), the failure and the time until nodectl noticed it, the restart; a
    tick at each checkpoint; the goodput and its lost time by kind in the title."""
    attempts = [a for a in (spent or {}).get("attempts") or [] if isinstance(a, dict) and _number(a.get("started"))
                and _number(a.get("ended"))]
    if not attempts:
        return False
    launched = attempts[0]["started"] - float((spent.get("lost_s") or {}).get("set-up") or 0.0)
    fig, axis = plt.subplots(figsize=(9, 1.4 + 0.6 * len(attempts)), dpi=100)
    used = set()

    def bar(row: int, begin, end, what: str) -> None:
        if not (_number(begin) and _number(end)) or end <= begin:
            return
        colour = dict(SPANS)[what]
        axis.barh(row, end - begin, left=begin - launched, height=0.5, color=colour,
                  label=what if what not in used else None)
        used.add(what)

    for row, attempt in enumerate(attempts):
        began, first, ended = attempt["started"], attempt.get("first_step"), attempt["ended"]
        failed, noticed = attempt.get("failed"), attempt.get("noticed")
        if row == 0:
            bar(row, launched, began, "set-up")
        stop = min(x for x in (failed, noticed, ended) if _number(x))
        bar(row, began, first if _number(first) else stop, "start-up")
        if _number(first):
            bar(row, first, stop, "training")
            redone = attempt.get("redone_s")
            if _number(redone) and redone > 0:   # the steps done again, from the checkpoint it went on from
                bar(row, first, min(stop, first + redone), "work redone")
        if _number(failed) and _number(noticed):
            bar(row, failed, noticed, "failed, not yet noticed")
        if _number(noticed) and row + 1 < len(attempts):
            bar(row, noticed, attempts[row + 1]["started"], "restarting")
    times = {r["step"]: r["time"] for r in metrics if isinstance(r.get("step"), int) and _number(r.get("time"))}
    saved = [times[r["step"]] for r in metrics if _number(r.get("checkpoint_s")) and r.get("step") in times]
    for when in saved:
        row = next((i for i, a in enumerate(attempts) if a["started"] <= when <= a["ended"]), None)
        if row is not None:
            axis.plot([when - launched] * 2, [row - 0.3, row + 0.3], color="black", linewidth=1.2,
                      label="checkpoint" if "checkpoint" not in used else None)
            used.add("checkpoint")
    axis.set_yticks(range(len(attempts)), [f"attempt {a.get('attempt', i)}" for i, a in enumerate(attempts)])
    axis.invert_yaxis()
    axis.set_xlabel("seconds since the launch")
    share, lost = spent.get("goodput"), spent.get("lost_s") or {}
    named = sorted(((k, v) for k, v in lost.items() if _number(v) and v >= 0.5), key=lambda kv: -kv[1])
    title = f"goodput {share * 100:.0f}%" if _number(share) else "goodput unknown"
    if named:
        title += "; lost " + ", ".join(f"{k} {v:.0f}s" for k, v in named[:5])
    axis.set_title(title, fontsize=9)
    axis.grid(alpha=0.3, axis="x")
    axis.legend(fontsize=7, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(attempts) < 3 else -0.15))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _pace_figure(plt, windows: list[dict], path: Path) -> bool:
    """Where each rank's time went over the run (computing, getting data, waiting for other ranks in
    collectives), the run's pace against its own healthy pace, and the straggler verdicts shaded, from the
    windows the attached launch judged (runs/<id>/pace.jsonl)."""
    windows = [w for w in windows if isinstance(w, dict) and _number(w.get("time")) and isinstance(w.get("ranks"), list)]
    if len(windows) < 2:
        return False
    start = windows[0]["time"]
    series: dict[str, dict[int, tuple[list, list]]] = {"computing": {}, "getting data": {},
                                                        "waiting for other ranks": {}}
    for window in windows:
        for entry in window["ranks"]:
            if not isinstance(entry, dict) or not isinstance(entry.get("rank"), int):
                continue
            busy, wait, data = (entry.get(k) if _number(entry.get(k)) else None for k in ("busy", "wait", "data"))
            values = {"computing": None if busy is None else busy - (data or 0.0), "getting data": data,
                      "waiting for other ranks": wait}
            for name, value in values.items():
                if value is not None:
                    xs, ys = series[name].setdefault(entry["rank"], ([], []))
                    xs.append(window["time"] - start)
                    ys.append(value * 100)
    panels = [name for name in series if series[name]]
    paced = [(w["time"] - start, w["pace"]) for w in windows if _number(w.get("pace"))]
    rows = len(panels) + (1 if paced else 0)
    fig, axes = plt.subplots(rows, 1, figsize=(8, 2.6 * rows), dpi=100, sharex=True, squeeze=False)
    axes = [a[0] for a in axes]
    spans, began = [], None   # the straggler verdicts: (from, to, rank)
    for window in windows:
        rank = window.get("straggler")
        if isinstance(rank, int) and began is None:
            began = (window["time"] - start, rank)
        elif not isinstance(rank, int) and began is not None:
            spans.append((began[0], window["time"] - start, began[1]))
            began = None
    if began is not None:
        spans.append((began[0], windows[-1]["time"] - start, began[1]))
    for axis, name in zip(axes, panels):
        for rank, (xs, ys) in sorted(series[name].items()):
            axis.plot(xs, ys, label=f"rank {rank}")
        axis.set_ylabel(f"% {name}", fontsize=8)
        axis.set_ylim(0, 100)
        axis.grid(alpha=0.3)
        if len(series[name]) <= 16:
            axis.legend(fontsize=7, ncol=4)
    if paced:
        axis = axes[-1]
        axis.plot([x for x, _ in paced], [y for _, y in paced], color="black", label="pace")
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set_ylabel("pace (x healthy)", fontsize=8)
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
    for axis in axes:
        for begin, end, rank in spans:
            axis.axvspan(begin, end, color="red", alpha=0.12)
    for begin, _, rank in spans:
        axes[0].annotate(f"straggler: rank {rank}", (begin, 95), fontsize=7, color="red", va="top")
    axes[0].set_title("where each rank's time goes, and the run's pace (straggler verdicts shaded)")
    axes[-1].set_xlabel("seconds since the first judged window")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def summarise(data: dict) -> dict:
    metrics, summary = data["metrics"], data["summary"] or {}
    steps, _ = _last_per_step(metrics, "loss")
    _, evals = _last_per_step(metrics, "eval_loss")
    _, speed = _last_per_step(metrics, "tokens_per_s_per_gpu")
    stop = [r["stop"] for r in metrics if isinstance(r.get("stop"), str) and r["stop"]]
    return {"steps": steps[-1] if steps else 0, "first_loss": _last_per_step(metrics, "loss")[1][0] if steps else None,
            "last_loss": _last_per_step(metrics, "loss")[1][-1] if steps else None,
            "best_eval_loss": min(evals) if evals else None,
            "tokens_per_s_per_gpu": statistics.median(speed[1:] or speed) if speed else None,
            "adapter": data["adapter"], "end_reason": _text(summary.get("end_reason")) or (stop[-1] if stop else "unknown"),
            "resumed_from": summary.get("resumed_from") if isinstance(summary.get("resumed_from"), (int, str)) else None}


def _text(value) -> str | None:
    return value[:300] if isinstance(value, str) else None
