"""Stacks and diagnose: each rank's stack (py-spy, its SIGUSR1 handler, or its listener) and CPU use."""
from __future__ import annotations

import errno
import os
import shutil
import signal
import stat
import subprocess
import sys
import time

import runlayout as layout
from runctl.common import listdir_nofollow, lstat_nofollow, no_run, open_nofollow, open_run_file, read_json
from runctl.processes import run_markers, signal_run_process
from runctl.watch import cmd_tail, gpu_sample, rank_state


def cmd_stacks(args: list, request: dict) -> dict:
    """Every rank's Python stack: py-spy where installed, else SIGUSR1 to programs that registered for it."""
    run_dir = os.path.expanduser(args[0])
    node = read_json(os.path.join(run_dir, layout.NODE_JSON), {})
    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    stacks = {}
    for rank in node.get("ranks", []):
        state = rank_state(run_dir, rank, time.time(), run_markers(run_dir))
        if not state["alive"]:
            stacks[str(rank)] = {"error": "not running"}
            continue
        stacks[str(rank)] = _stack_of(run_dir, rank, state["pid"], py_spy)
    return {"stacks": stacks, "tool": "py-spy" if py_spy else "faulthandler"}


def _stack_of(run_dir: str, rank: int, pid: int, py_spy) -> dict:
    if py_spy:
        proc = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
        if proc.returncode == 0:
            return {"text": proc.stdout}
    ready = os.path.join(run_dir, "stacks", f"rank{rank}.ready")
    if lstat_nofollow(ready) is None:
        text = _listener_stack(run_dir, rank)
        if text:
            return {"text": text}
        return {"error": "py-spy is not installed on the node, the program registered no SIGUSR1 handler and its "
                         "listener did not answer (a program run with -S or -I has none; `pip install py-spy` "
                         "covers any program)"}
    path = os.path.join(run_dir, "stacks", f"rank{rank}.txt")
    before = _size(path)
    if not signal_run_process(pid, signal.SIGUSR1, run_markers(run_dir)):
        return {"error": "the rank ended before its stack could be taken"}
    for _ in range(50):
        time.sleep(0.1)
        if _size(path) > before:
            time.sleep(0.2)  # let faulthandler finish every thread
            break
    with open_run_file(path, text=False) as handle:
        handle.seek(before)
        return {"text": handle.read().decode("utf-8", errors="replace")}


def _size(path: str) -> int:
    info = lstat_nofollow(path)
    return info.st_size if info is not None and stat.S_ISREG(info.st_mode) else 0


def _listener_stack(run_dir: str, rank: int, wait: float = 5.0) -> str:
    """Every thread's stack from the rank's own listener (lib/sitecustomize.py), as text; "" without an answer."""
    request_id, asked = f"stacks-{time.time_ns()}-{os.getpid()}", time.time()
    deadline = time.monotonic() + wait
    if not _ask_listener(run_dir, rank, request_id, deadline):
        return ""
    while time.monotonic() < deadline:
        answer = read_json(os.path.join(run_dir, layout.rank_answer(rank)))
        if _answers(answer, request_id, asked) and answer.get("threads"):
            lines = [f"Process {answer.get('pid')} (rank {rank}; from its listener)"]
            for thread in answer["threads"]:
                lines.append(f"Thread {thread.get('native_id')} ({thread.get('name')})"
                             f"{' [main]' if thread.get('main') else ''}")
                for filename, lineno, function, code in reversed(thread.get("frames") or []):
                    lines.append(f"    {function} ({filename}:{lineno})" + (f"\n        {code}" if code else ""))
            return "\n".join(lines) + "\n"
        time.sleep(0.05)
    return ""


def _cpu_ticks(pid: int) -> dict:
    """{thread id: (state letter, user + system clock ticks)} of a process's threads; {} when it is gone."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="utf-8") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            out[int(tid)] = (fields[0], int(fields[11]) + int(fields[12]))
        except (OSError, IndexError, ValueError):
            continue
    return out


def _cpu_use(before: dict, after: dict, seconds: float, skip=None) -> dict:
    """The process's CPU use between two samples, in % of one core, with its busiest threads (not counting
    `skip`, the listener answering the request)."""
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    per_thread = {tid: round(100.0 * (after[tid][1] - before.get(tid, (None, after[tid][1]))[1]) / hz / seconds, 1)
                  for tid in after if tid != skip}
    busiest = sorted(per_thread.items(), key=lambda item: -item[1])[:8]
    return {"percent": round(sum(per_thread.values()), 1), "threads": {str(t): p for t, p in busiest if p > 0},
            "seconds": round(seconds, 2)}


def _answers(answer, request_id: str, asked: float) -> bool:
    """Whether a listener's answer does for a request: one to it, or one whose snapshot began after it was asked.
    Another diagnosis asking at the same moment may have had its own answered in between and written over this
    one's; a snapshot taken since is as new as the one asked for."""
    if not isinstance(answer, dict):
        return False
    taken = answer.get("time")
    return request_id in (answer.get("requests") or ()) or isinstance(taken, (int, float)) and taken >= asked


LISTENER_GRACE = 1.0   # seconds a rank whose listener never answered may leave its FIFO unread


def _ask_listener(run_dir: str, rank: int, request_id: str, deadline: float) -> bool:
    """Write a request to a rank's listener (launchers/sitecustomize.py); False when none reads the FIFO (the
    program is not Python, ran with -S or -I, or ended). A listener holds the FIFO open from the rank's start, but
    one of a run started by an earlier nodectl opened it only between answers: one that has answered before is
    waited for until `deadline` (on 2 loaded cores one answer took over a second, and a third asker gave up), one
    that never has for LISTENER_GRACE."""
    fifo = os.path.join(run_dir, layout.rank_request(rank))
    grace = time.monotonic() + LISTENER_GRACE
    while True:
        try:   # the FIFO the rank made: never a link, a host file or a device put in its place
            fd = open_nofollow(fifo, os.O_WRONLY | os.O_NONBLOCK)
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                os.close(fd)
                return False
        except OSError as exc:
            now = time.monotonic()
            if exc.errno == errno.ENXIO and now < deadline and (   # between two requests: it reopens
                    now < grace or lstat_nofollow(os.path.join(run_dir, layout.rank_answer(rank))) is not None):
                time.sleep(0.05)
                continue
            return False
        try:
            os.write(fd, (request_id + "\n").encode())
            return True
        except OSError:
            return False
        finally:
            os.close(fd)


def cmd_diagnose(args: list, request: dict) -> dict:
    """Everything `nodectl diagnose` judges, from every rank of this node at once: its state and heartbeat, what
    its listener answers from inside the process (every thread's stack, the flight recorder), its CPU use over
    about a second, its last log lines; py-spy or faulthandler for a rank without a listener."""
    run_dir = os.path.expanduser(args[0])
    node = read_json(os.path.join(run_dir, layout.NODE_JSON))
    if node is None:
        return no_run(run_dir)
    wait, lines = float(request.get("wait", 5.0)), int(request.get("lines", 20))
    markers, started = run_markers(run_dir), time.monotonic()
    states = {rank: rank_state(run_dir, rank, time.time(), markers) for rank in node["ranks"]}
    live = {rank: state["pid"] for rank, state in states.items() if state["alive"]}
    before = {rank: _cpu_ticks(pid) for rank, pid in live.items()}
    request_id, asked_at = f"{time.time_ns()}-{os.getpid()}", time.time()
    deadline = started + wait
    asked = {rank for rank in live if _ask_listener(run_dir, rank, request_id, deadline)}
    answers = {}
    while len(answers) < len(asked) and time.monotonic() < deadline:
        for rank in asked - set(answers):
            answer = read_json(os.path.join(run_dir, layout.rank_answer(rank)))
            if _answers(answer, request_id, asked_at):
                answers[rank] = answer
        time.sleep(0.05)
    time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))   # CPU use over a second at least
    seconds = time.monotonic() - started
    after = {rank: _cpu_ticks(pid) for rank, pid in live.items()}
    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    tails = cmd_tail([run_dir], {"ranks": node["ranks"], "lines": lines})["logs"]
    out = {}
    for rank, state in states.items():
        entry = dict(state, log_tail=tails.get(str(rank), {}).get("text", ""))
        if rank in live:
            entry["cpu"] = _cpu_use(before[rank], after[rank], seconds, (answers.get(rank) or {}).get("listener_tid"))
            entry["main_state"] = (after[rank].get(live[rank]) or ("?",))[0]
            if rank in answers:
                entry["listener"] = answers[rank]
            else:
                entry["listener_error"] = ("its listener did not answer within {:.0f} s".format(wait)
                                           if rank in asked else "no listener in the process")
                entry["stack"] = _stack_of(run_dir, rank, live[rank], py_spy)
        out[str(rank)] = entry
    flight = os.path.join(run_dir, layout.FLIGHT)
    timeout_dumps = sorted(name for name in listdir_nofollow(flight) if name.startswith("rank_"))
    return {"now": time.time(), "node_rank": node["node_rank"], "ranks": out,
            "launcher_exit": read_json(os.path.join(run_dir, layout.LAUNCHER_EXIT)),
            "gpu_sample": gpu_sample() if shutil.which("nvidia-smi") else None, "timeout_dumps": timeout_dumps}
