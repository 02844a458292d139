"""A run's state and its logs: poll, watch (the same state as a stream), tail, a GPU sample, the uploader's
record."""
from __future__ import annotations

import json
import os
import re
import select
import signal
import stat
import subprocess
import sys
import time

import runlayout as layout
from runctl.common import READ_LIMIT, boot_id, is_file, listdir_nofollow, lstat_nofollow, no_run, open_run_file, read_json
from runctl.processes import belongs, is_zombie, record_seen, run_markers, run_processes


def rank_state(run_dir: str, rank: int, now: float, markers: tuple) -> dict:
    """A rank as its node sees it. Whether the rank and its wrapper live is read before the exit record the
    wrapper writes once the rank ended: a rank that ends meanwhile is seen with its record, or as `ending` (gone,
    its wrapper still to write the record), never as gone without one (which `status` calls killed)."""
    pid = _recorded_pid(run_dir, layout.rank_pid(rank))
    alive = pid is not None and belongs(pid, markers) and not is_zombie(pid)
    wrapper = None if alive else _recorded_pid(run_dir, layout.rank_wrapper(rank))
    wrapping = wrapper is not None and belongs(wrapper, markers) and not is_zombie(wrapper)
    state = {"rank": rank, "pid": pid, "alive": alive, "exit": read_json(os.path.join(run_dir, layout.rank_exit(rank)))}
    if wrapping and state["exit"] is None:
        state["ending"] = True
    heartbeat = read_json(os.path.join(run_dir, layout.heartbeat(rank)))
    if isinstance(heartbeat, dict):
        state["heartbeat"] = heartbeat
        state["heartbeat_age"] = round(now - float(heartbeat.get("time", now)), 1)
    info = lstat_nofollow(os.path.join(run_dir, layout.rank_log(rank)))
    state["log_size"] = info.st_size if info is not None and stat.S_ISREG(info.st_mode) else 0
    return state


CHECKPOINT = re.compile(r"ckpt-(\d{1,12})")   # the built-in trainer's output/checkpoints/ckpt-<step>/COMPLETE


def latest_checkpoint(run_dir: str):
    """The step of the newest complete checkpoint of the built-in trainer's in this node's output/ (a folder
    ckpt-<step> holding COMPLETE, written last), or None."""
    folder = os.path.join(run_dir, "output", "checkpoints")
    try:
        names = listdir_nofollow(folder)
    except OSError:
        return None
    steps = sorted((int(m[1]) for m in map(CHECKPOINT.fullmatch, names) if m), reverse=True)
    for step in steps[:8]:
        if is_file(os.path.join(folder, f"ckpt-{step:07d}", "COMPLETE")):
            return step
    return None


def _recorded_pid(run_dir: str, relative: str):
    try:
        with open_run_file(os.path.join(run_dir, relative)) as handle:
            return int(handle.read())
    except (OSError, ValueError):
        return None


def _read_from(path: str, offset: int) -> tuple:
    """(new offset, text) of a log from `offset`: whole lines, up to READ_LIMIT bytes, or what there is at the
    end of the file. A line longer than READ_LIMIT is never waited for (that stalled the stream for good): it is
    shortened to layout.LINE_MAX characters with a marker, keeping its latest \\r state (a progress bar), else its
    start."""
    try:
        with open_run_file(path, text=False) as handle:
            handle.seek(offset)
            data = handle.read(READ_LIMIT)
            if len(data) < READ_LIMIT:
                return offset + len(data), data.decode("utf-8", errors="replace")
            cut = data.rfind(b"\n") + 1
            if cut:
                return offset + cut, data[:cut].decode("utf-8", errors="replace")
            end = _next_newline(handle, offset + len(data))
            stop = end if end is not None else os.fstat(handle.fileno()).st_size
            handle.seek(max(offset, stop - layout.LINE_MAX))
            tail = handle.read(stop - max(offset, stop - layout.LINE_MAX))
    except OSError:
        return offset, ""
    if b"\r" in tail:
        kept = tail.rsplit(b"\r", 1)[-1]  # a progress bar: its latest state
    elif b"\r" in data:
        kept = tail
    else:
        kept = data[:layout.LINE_MAX]
    marker = f" [line cut by nodectl: {stop - offset} bytes]"
    text = kept[:layout.LINE_MAX].decode("utf-8", errors="replace") + marker
    return (end + 1, text + "\n") if end is not None else (stop, text)


def _next_newline(handle, position: int):
    """The offset of the next newline at or after `position`, or None at the end of the file."""
    handle.seek(position)
    while True:
        block = handle.read(1 << 20)
        if not block:
            return None
        found = block.find(b"\n")
        if found >= 0:
            return position + found
        position += len(block)


GPU_FIELDS = ("index", "utilization.gpu", "memory.used", "memory.total", "temperature.gpu", "power.draw")
GPU_KEYS = ("index", "util", "mem_used_mib", "mem_total_mib", "temp_c", "power_w")


def gpu_sample() -> dict:
    """Every GPU of the node through nvidia-smi (part of every driver install): {"gpus": [...]} or {"error": ...}."""
    try:
        proc = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(GPU_FIELDS)}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10)
    except FileNotFoundError:
        return {"error": "nvidia-smi not found (no NVIDIA driver on this node)"}
    except subprocess.TimeoutExpired:
        return {"error": "nvidia-smi did not answer within 10 s"}
    if proc.returncode != 0:
        return {"error": f"nvidia-smi failed: {(proc.stderr or proc.stdout).strip()[:200]}"}
    gpus = []
    for line in proc.stdout.splitlines():
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) != len(GPU_KEYS):
            continue
        row = {}
        for key, cell in zip(GPU_KEYS, cells):
            try:
                row[key] = int(cell) if key == "index" else float(cell)
            except ValueError:  # [N/A], [Not Supported]
                row[key] = None
        gpus.append(row)
    return {"gpus": gpus}


def cmd_poll(args: list, request: dict, stream: bool = False) -> dict:
    """The node's state for one run, plus new log text for the ranks asked for (from their offsets); with
    `hardware`, what its GPUs and ports did since the run started (runctl/hardware.py)."""
    run_dir, now = os.path.expanduser(args[0]), time.time()
    node = read_json(os.path.join(run_dir, layout.NODE_JSON))
    if node is None:
        return no_run(run_dir)
    pids = run_processes(run_dir)
    record_seen(run_dir, pids)
    answer = {"now": now, "node_rank": node["node_rank"], "alive": len(pids),
              "launcher_exit": read_json(os.path.join(run_dir, layout.LAUNCHER_EXIT)),
              "started": is_file(os.path.join(run_dir, layout.PGID)),
              "stopped": is_file(os.path.join(run_dir, layout.STOPPED)),
              "ranks": [rank_state(run_dir, rank, now, run_markers(run_dir)) for rank in node["ranks"]], "logs": {}}
    try:
        with open_run_file(os.path.join(run_dir, layout.BOOT)) as handle:
            started_boot = handle.read().strip()
        answer["same_boot"] = bool(started_boot) and started_boot == boot_id()
    except OSError:
        pass
    if request.get("checkpoint"):
        answer["checkpoint"] = latest_checkpoint(run_dir)
    for rank, offset in (request.get("offsets") or {}).items():
        new_offset, text = _read_from(os.path.join(run_dir, layout.rank_log(rank)), int(offset))
        answer["logs"][rank] = {"from": int(offset), "offset": new_offset, "text": text}
    if request.get("gpus"):
        answer["gpu_sample"] = gpu_sample()
    if request.get("hardware") and answer["started"]:
        from runctl import hardware

        answer["hardware"] = hardware.look(run_dir, now, stream=stream)
    if isinstance(request.get("pace"), dict):
        from runctl.pace import busiest_others, first_look, gpu_detail, node_cpu, rank_pace

        pids = {str(r["rank"]): r["pid"] for r in answer["ranks"] if r.get("alive")}
        earlier = first_look(pids) if pids else {}   # a run whose ranks are gone: nothing to wait for
        answer["pace"] = {"ranks": {rank: rank_pace(run_dir, int(rank), pids.get(rank), int(since or 0))
                                    for rank, since in request["pace"].items() if str(rank).isdigit()},
                          "cpu": {**node_cpu(), **({"others": busiest_others(run_markers(run_dir))} if pids else {})}}
        for rank, counters in earlier.items():
            if rank in answer["pace"]["ranks"]:
                answer["pace"]["ranks"][rank]["earlier"] = counters
        if request.get("gpu_detail"):
            answer["pace"]["gpus"] = gpu_detail(set(pids.values()))
    upload = read_json(os.path.join(run_dir, layout.UPLOAD))
    if isinstance(upload, dict):
        answer["upload"] = _upload_state(upload, now, run_markers(run_dir))
    return answer


WATCH_INTERVAL = (0.2, 60.0)   # the bounds of the seconds between two state lines
ASK_LIMIT = 1 << 20            # bytes of one request line; a longer one is dropped
ENDS_EVERY = 0.1               # seconds between two looks, between lines, for a rank's or the launcher's exit record


def cmd_watch(args: list, request: dict) -> dict:
    """The run's state as a stream: `poll`'s answer, with its `seq` and the `asked` time of the latest request
    line, written as one line every `interval` seconds until stdin ends (the controller closed its channel, or
    its connection went) or stdout breaks. One process for the whole watch: a node under load answers with a
    line on time instead of starting two interpreters a poll. A rank's or the launcher's exit record that appears
    between two lines sends the next one at once (a crash is news the controller should not wait a line for).

    The watcher moves its own log offsets and pace marks on as it sends, so the controller needs to send
    nothing; a request line (one JSON object) replaces `offsets`, raises `pace` marks and sets `gpus`,
    `gpu_detail` and `sent` when the controller's view changes."""
    run_dir = args[0]
    ask = {"offsets": {}, "pace": None, "gpus": False, "gpu_detail": False, "hardware": False, "sent": None}
    _take(ask, request)
    interval = min(max(_seconds(request.get("interval"), 1.0), WATCH_INTERVAL[0]), WATCH_INTERVAL[1])
    # A controller cut off by the network neither closes the stream nor reads it: a write then blocks for good.
    # SIGALRM (its default action ends the process) after `orphan_after` seconds without a request line.
    orphan_after = int(_seconds(request.get("orphan_after"), 0))
    if orphan_after > 0:
        signal.alarm(orphan_after)
    pending, seq = bytearray(), 0
    node = read_json(os.path.join(os.path.expanduser(run_dir), layout.NODE_JSON))
    ends = [os.path.join(os.path.expanduser(run_dir), path) for path in
            [layout.LAUNCHER_EXIT, *(layout.rank_exit(rank) for rank in (node or {}).get("ranks", []))]]
    while True:
        ended = sum(map(os.path.exists, ends))
        answer = cmd_poll([run_dir], {k: v for k, v in ask.items() if k != "sent"}, stream=True)
        seq += 1
        answer.update(seq=seq, asked=ask["sent"])
        try:
            sys.stdout.write(json.dumps(answer) + "\n")
            sys.stdout.flush()
        except (OSError, ValueError):
            return {"ended": "the controller stopped reading"}
        if answer.get("no_run"):
            return {"ended": "no such run"}
        _moved_on(ask, answer)
        deadline = time.monotonic() + interval
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([0], [], [], min(left, ENDS_EVERY))[0]:
                if sum(map(os.path.exists, ends)) != ended:   # a rank or the launcher ended: said at once
                    break
                continue
            data = os.read(0, 1 << 16)
            if not data:
                return {"ended": "the controller closed the stream"}
            pending += data
            *lines, rest = bytes(pending).split(b"\n")
            pending = bytearray(rest if len(rest) <= ASK_LIMIT else b"")
            for line in lines:
                try:
                    _take(ask, json.loads(line))
                except (ValueError, RecursionError):
                    continue
                if orphan_after > 0:
                    signal.alarm(orphan_after)


def _seconds(value, default: float) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value \
        else default


def _take(ask: dict, update) -> None:
    """A request (line) applied to what the watcher asks; fields of the wrong type are ignored."""
    if not isinstance(update, dict):
        return
    if isinstance(update.get("offsets"), dict):
        ask["offsets"] = {str(r): int(o) for r, o in update["offsets"].items()
                          if str(r).isdigit() and isinstance(o, int) and not isinstance(o, bool) and o >= 0}
    if isinstance(update.get("pace"), dict):
        marks = ask["pace"] if isinstance(ask["pace"], dict) else {}
        for rank, since in update["pace"].items():
            if str(rank).isdigit() and isinstance(since, int) and not isinstance(since, bool):
                marks[str(rank)] = max(marks.get(str(rank), 0), since)
        ask["pace"] = marks
    for flag in ("gpus", "gpu_detail", "hardware"):
        if isinstance(update.get(flag), bool):
            ask[flag] = update[flag]
    if "sent" in update:
        ask["sent"] = _seconds(update["sent"], None)


def _moved_on(ask: dict, answer: dict) -> None:
    """The offsets and pace marks after what this answer carried, as the controller will have them."""
    for rank, chunk in answer.get("logs", {}).items():
        ask["offsets"][rank] = chunk["offset"]
    for rank, pace in ((answer.get("pace") or {}).get("ranks") or {}).items():
        reached = pace.get("reached") if isinstance(pace, dict) else None
        if reached and isinstance(ask["pace"], dict):
            ask["pace"][rank] = max([ask["pace"].get(rank, 0), *reached])


def _upload_state(upload: dict, now: float, markers: tuple) -> dict:
    """The uploader's own record, with the one thing it cannot say itself: that it is gone before its last round
    (killed, or the node ran out of memory). Its pid counts only while that process is still this run's."""
    pid = upload.get("pid")
    if upload.get("final") or upload.get("ended") or not isinstance(pid, int) or isinstance(pid, bool):
        return upload
    if belongs(pid, markers) and not is_zombie(pid):
        return upload
    return dict(upload, error=f"the uploader (pid {pid}) ended before its last round (killed?): what it had not "
                              f"sent is not in the bucket, and nothing half-sent is taken; `launch --resume` starts "
                              f"a new one", error_time=upload.get("error_time") or now)


def cmd_tail(args: list, request: dict) -> dict:
    """The last `lines` lines of each rank's log, with the offset a follower continues from."""
    run_dir = args[0]
    if not is_file(os.path.join(run_dir, layout.NODE_JSON)):
        return no_run(run_dir)
    lines, out = int(request.get("lines", 20)), {}
    for rank in request["ranks"]:   # "launcher": torchrun's own log (launch.sh's output)
        name = "launcher.log" if rank == "launcher" else f"rank{int(rank)}.log"
        path = os.path.join(run_dir, "logs", name)
        try:
            with open_run_file(path, text=False) as handle:
                size = os.fstat(handle.fileno()).st_size
                handle.seek(max(0, size - 64 * 1024 * max(1, lines // 100 + 1)))
                text = handle.read().decode("utf-8", errors="replace")
        except OSError:
            size, text = 0, ""
        kept = text.splitlines()[-lines:] if lines > 0 else []
        out[str(rank)] = {"offset": size, "text": "\n".join(kept) + ("\n" if kept else "")}
    return {"logs": out}
