"""A rank's latest collectives for the pace verdict, read from torch's flight recorder. Standard library only.

How they are read decides what the reading costs the run. torch's Python dump (`_dump_nccl_trace`) holds the GIL
while it copies and pickles the whole recorder (2000 entries: 20-40 ms on a GPU node, 130 ms with gloo on a small
CPU), and the program's own thread waits that long; in synchronous training every rank's wait is every rank's
loss. So a rank that can serves its recorder through torch's own worker server instead (a C++ thread, a unix
socket in the run's flight/ folder: `torch._C._distributed_c10d._WorkerServer`) and records where in its pace
file; runctl, a separate process, asks it when a controller polls, at most every few seconds, and keeps the rows
in the same pace file. The rank's Python never runs for it. A torch without the server's JSON handlers keeps the
old way: the rank's pace thread copies in-process, at wall-clock ticks shared by every rank, so the ranks wait at
the same moment and not one after another.

Shipped into the run's lib/ (for sitecustomize.py) and inside runctl's artifact."""
from __future__ import annotations

import json
import os
import socket
import stat

PACE_ENTRIES = 600   # the latest collectives a pace file keeps
HANDLERS = ("dump_nccl_trace_json", "fr_trace_json")   # the worker server's JSON dumps: NCCL's recorder, gloo's
DTYPE_BYTES = {"Double": 8, "Long": 8, "ComplexFloat": 8, "Float": 4, "Int": 4, "BFloat16": 2, "Half": 2,
               "Short": 2, "Byte": 1, "Char": 1, "Bool": 1}


def pace_rows(entries: list, timed: bool) -> list:
    """The recorder's entries (oldest first) as the pace file's rows: [group, sequence id, reached (ns since the
    epoch), duration in ms or None, bytes moved, kind]. With NCCL timing on, the rows stop at the first collective
    still running: NCCL times it once it completes, and it comes in a later copy with its duration."""
    rows = []
    for entry in entries[-PACE_ENTRIES:]:
        if not isinstance(entry, dict):
            continue
        if timed and str(entry.get("profiling_name", "")).startswith("nccl:") \
                and entry.get("state") in ("scheduled", "started"):
            break
        seq, reached = entry.get("collective_seq_id"), entry.get("time_created_ns")
        if entry.get("is_p2p") or not isinstance(seq, int) or not isinstance(reached, int):
            continue
        duration = entry.get("duration_ms")
        rows.append([str(entry.get("pg_id", (entry.get("process_group") or ("?",))[0])), seq, reached,
                     round(float(duration), 3) if isinstance(duration, (int, float)) else None, *moved(entry)])
    return rows


def moved(entry: dict) -> list:
    """[bytes, kind] of a collective as nccl-tests counts them (an all-reduce's or reduce-scatter's input, an
    all-gather's output), kind one of allreduce, gather, scatter, alltoall, other: the controller turns them into
    bus bandwidth with the group's size."""
    name = str(entry.get("profiling_name", "")).split(":", 1)[-1]
    kind = ("allreduce" if "all_reduce" in name or "allreduce" in name else
            "gather" if "gather" in name else "scatter" if "scatter" in name else
            "alltoall" if "all_to_all" in name or "alltoall" in name else "other")
    sizes, dtypes = (entry.get("output_sizes"), entry.get("output_dtypes")) if kind == "gather" else \
        (entry.get("input_sizes"), entry.get("input_dtypes"))
    total = 0
    try:
        for shape, dtype in zip(sizes or (), dtypes or ()):
            count = 1
            for dim in shape:
                count *= int(dim)
            total += count * DTYPE_BYTES.get(str(dtype), 1 if str(dtype).startswith("Float8") else 4)
    except (TypeError, ValueError):
        return [None, kind]
    return [total, kind]


BODY_LIMIT = 64 << 20   # a recorder's dump without stack traces: a few MiB at most (2,000 entries)


def _request(dir_fd: int, name: str, method: str, target: str, timeout: float) -> tuple[int, bytes]:
    """(status, body) of one HTTP request to a worker server's socket `name` in the folder open as `dir_fd`. The
    socket is opened without following a link and must be one (a rank, or a container's root, may leave a link to
    another program's socket in its folder), then reached through its own descriptor: a run folder's path can also
    be longer than a socket's address may be (108 bytes). The whole exchange has `timeout` seconds (a server that
    drips a byte at a time is cut off then, not after each quiet gap) and the body at most BODY_LIMIT bytes (a rank
    serving 3 GB grew runctl to 2.6 GB): past either, ValueError. http.client is imported here, when a copy is due:
    a poll that needs none does not pay for it."""
    import http.client
    import threading

    class Unix(http.client.HTTPConnection):
        def connect(self) -> None:
            path_fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            try:
                if not stat.S_ISSOCK(os.fstat(path_fd).st_mode):
                    raise OSError(f"{name} is not a socket")
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.settimeout(self.timeout)
                self.sock.connect(f"/proc/self/fd/{path_fd}")
            finally:
                os.close(path_fd)

    connection = Unix("localhost", timeout=timeout)
    expired = threading.Event()

    def cut() -> None:   # past the deadline: whatever read is blocked returns, and the answer is refused
        expired.set()
        if connection.sock is not None:
            try:
                connection.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(timeout, cut)
    timer.daemon = True
    timer.start()
    try:
        connection.request(method, target)
        response = connection.getresponse()
        chunks, size = [], 0
        while size <= BODY_LIMIT:
            chunk = response.read1(65536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > BODY_LIMIT:
            raise ValueError(f"the worker server's answer is over {BODY_LIMIT >> 20} MiB")
        if expired.is_set():
            raise ValueError(f"the worker server did not answer within {timeout:g} s")
        return response.status, b"".join(chunks)
    except (http.client.HTTPException, OSError) as exc:
        if expired.is_set():
            raise ValueError(f"the worker server did not answer within {timeout:g} s") from None
        if isinstance(exc, OSError):
            raise
        raise ValueError(f"the worker server's answer: {exc}") from None
    finally:
        timer.cancel()
        connection.close()


def _json(body: bytes):
    """A worker server's JSON answer; one nested too deep (or not JSON) is ValueError, never RecursionError."""
    try:
        return json.loads(body)
    except RecursionError:
        raise ValueError("the worker server's answer is nested too deep") from None


def socket_address(dir_fd: int, name: str) -> str:
    """The address a worker server binds to: the socket `name` in the folder open as `dir_fd`."""
    return f"/proc/self/fd/{dir_fd}/{name}"


def handler_names(dir_fd: int, name: str, timeout: float = 5.0) -> list:
    """The handlers the worker server at `name` has (torch registers them by build and version)."""
    status, body = _request(dir_fd, name, "GET", "/handler/", timeout)
    names = _json(body) if status == 200 else []
    return [str(n) for n in names] if isinstance(names, list) else []


def fetch(dir_fd: int, name: str, handler: str, timeout: float = 5.0) -> list:
    """The recorder's entries (oldest first) from the worker server at `name`, without stack traces. Raises
    OSError (no server there: the rank is gone) or ValueError (an answer that is not the recorder's)."""
    status, body = _request(dir_fd, name, "POST", f"/handler/{handler}?includecollectives=true&onlyactive=false",
                            timeout)
    if status != 200:
        raise ValueError(f"the worker server answered {status}")
    dump = _json(body)
    entries = dump.get("entries") if isinstance(dump, dict) else None
    return entries if isinstance(entries, list) else []
