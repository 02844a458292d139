"""nodectl's listener inside every rank, for `nodectl diagnose`: any torchrun script, unmodified.

rankexec.py puts the run's lib/ folder (this file's) on the rank's PYTHONPATH and names a FIFO in
NODECTL_RANK_HELPER; Python imports `sitecustomize` at start-up, so this runs in the rank's process before its
program. It starts one daemon thread that blocks reading the FIFO: it costs nothing until runctl's `diagnose`
writes a request to it. It then answers, from inside the live process, even when the main thread waits in a
collective (torch releases the GIL there) or spins in Python (the GIL is handed over every few ms):
- the Python stack of every thread (`sys._current_frames`);
- torch's flight recorder (the NCCL one and the CPU/gloo one, whichever this torch has): the process groups and
  the latest collectives with their sequence ids, ops, sizes and states, without the recorded stack traces
  (symbolising them took 3 s of CPU per rank on the first dump; the threads' stacks say where each rank is). The answer holds a trimmed JSON copy;
  the full dump goes next to it as the pickle torch writes, for torch's own analyser (`torchfrtrace`).
The answer is written to flight/rank<R>.answer.json in the run folder, atomically, with the ids of the requests
it answers and the time its snapshot began.

A second daemon thread keeps the rank's pace (NODECTL_PACE_EVERY seconds, 0: off): every few seconds it copies the
latest collectives from the flight recorder (process group, sequence id, when this rank reached it, and on NCCL
with timing how long it took) to flight/rank<R>.pace.json. Comparing when each rank reaches the same collective
tells the rank the others wait for (nodectl/pace.py); the program itself is never touched.

The variable is removed from the environment at once, so the rank's own child processes (data loader workers,
a compile pool) do not start listeners of their own. A sitecustomize that was already on the path (a
distribution's, a virtualenv's) still runs: it is imported after this one. Standard library only.
"""
from __future__ import annotations

# Everything the daemon threads use is imported here, by the program's thread at start-up: a daemon thread that
# imports races the interpreter's exit, whose teardown frees the import lock (a 3-line script that exits at once
# was killed by SIGSEGV in 4% of runs on a loaded machine, the pace thread inside `import` in the core dump).
import atexit
import json
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import warnings

import flightpace            # beside this file in lib/, as the three below
import framework_phases
import runlayout as layout   # the run folder's names, written once
from nodeio import write_file

ENTRIES_PER_GROUP = 32      # the latest collectives of each process group kept in the JSON answer
_PACE_STOPPED: list = []     # set by the program's exit: the pace thread reads the recorder no more
FRAMES_PER_THREAD = 48
FRAMES_PER_ENTRY = 12


def _start() -> None:
    fifo = os.environ.pop("NODECTL_RANK_HELPER", None)
    run_dir, rank = os.environ.get("NODECTL_RUN_DIR"), os.environ.get("RANK")
    if not run_dir or rank is None:
        return
    framework_phases.install()   # HF Trainer's and Lightning's checkpoints, evaluations and steps, for the ledger
    if not fifo:
        return
    listener = threading.Thread(target=_serve, args=(fifo, run_dir, rank),
                                name="nodectl-diagnose", daemon=True)
    listener.start()
    threads = [listener]
    every = _seconds(os.environ.pop("NODECTL_PACE_EVERY", ""))
    if every:
        pace = threading.Thread(target=_keep_pace, args=(run_dir, rank, every), name="nodectl-pace", daemon=True)
        pace.start()
        threads.append(pace)
    _quiet_fork(threads)


def _seconds(text: str) -> float:
    try:
        return max(0.0, float(text))
    except ValueError:
        return 0.0


def _quiet_fork(ours: list) -> None:
    """Python 3.12 warns at every fork() of a process with more than one thread ("This process is multi-threaded,
    use of fork() may lead to deadlocks in the child"). A program with no thread of its own would get it at each
    fork only because of nodectl's threads, which wait in read() or sleep holding no lock: so while they are the
    only other threads (by the kernel's count and by Python's), that warning is filtered out for the fork. A
    program that runs threads of its own still gets it, as it should."""
    held = []

    def before() -> None:
        try:
            with open("/proc/self/stat", encoding="ascii") as handle:
                threads = int(handle.read().rsplit(")", 1)[1].split()[17])
        except (OSError, IndexError, ValueError):
            return
        alive = sum(1 for thread in ours if thread.is_alive())
        if threads == alive + 1 and threading.active_count() == alive + 1:
            quiet = warnings.catch_warnings()
            quiet.__enter__()
            warnings.filterwarnings("ignore", message=r"This process \(pid=\d+\) is multi-threaded",
                                    category=DeprecationWarning)
            held.append(quiet)

    def after() -> None:
        while held:
            held.pop().__exit__(None, None, None)

    os.register_at_fork(before=before, after_in_parent=after, after_in_child=after)


def _serve(fifo: str, run_dir: str, rank: str) -> None:
    # Every signal blocked in this thread: a signal sent to the process then goes to the program's own threads,
    # never here. A program that blocks SIGTERM and takes it with sigtimedwait (to checkpoint first) was killed
    # by the default action through this thread, which had it unblocked.
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    # The FIFO stays open for reading, and for writing by this thread too, so a read never meets its end: a request
    # written while another is answered waits in the pipe. A reader that closed it after each request lost any
    # written between its last read and its close (one asker of six got no answer in a loaded CI run). runctl
    # still finds no reader once the process has ended; a forked child (a data loader's worker) closes both ends.
    try:
        info = os.stat(fifo)
        # before the FIFO is opened: a fork by the program's own thread can come at any moment after
        os.register_at_fork(after_in_child=lambda: _close_if((info.st_dev, info.st_ino)))
        reading = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        os.open(fifo, os.O_WRONLY)   # kept open, never used: no read meets an end
        os.set_blocking(reading, True)
    except OSError:
        return   # the run folder is gone: nothing will ask
    pending = b""
    while True:
        try:
            pending += os.read(reading, 4096)   # blocks (the GIL released) until a request is written
        except OSError:
            return
        done, _, pending = pending.rpartition(b"\n")   # whole lines: two asking at once get one answer
        pending = pending[-4096:]   # a writer that never ends its line holds no more than this
        requests = done.decode("ascii", "replace").split()
        if not requests:
            continue
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)   # a main thread spinning in Python holds the GIL 5 ms per hand-over
        try:
            answer = _snapshot(os.path.join(run_dir, layout.FLIGHT), rank)
        except Exception as exc:  # noqa: BLE001 - whatever fails here must never reach the rank's program
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            sys.setswitchinterval(interval)
        answer["requests"] = requests[:16]
        _write_json(os.path.join(run_dir, layout.rank_answer(rank)), answer)


def _close_if(fifo_id: tuple) -> None:
    """In a forked child: close every descriptor that is the listener's FIFO, found by its file rather than by
    number (a grandchild forked later runs this again, when the listener's numbers may name the child's own files)."""
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        try:
            info = os.fstat(fd)
            if (info.st_dev, info.st_ino) == fifo_id:
                os.close(fd)
        except OSError:
            pass


def _keep_pace(run_dir: str, rank: str, every: float) -> None:
    """The rank's pace (lib/flightpace.py): once the program has imported torch.distributed itself, its flight
    recorder is served to runctl through torch's worker server, and this thread ends. Where this torch cannot,
    every `every` seconds (at wall-clock multiples of it, the same moment on every rank) the latest collectives
    are copied in-process to flight/rank<R>.pace.json."""
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    path = os.path.join(run_dir, layout.rank_pace(rank))
    timed = os.environ.get("TORCH_NCCL_ENABLE_TIMING") == "1"
    # looked for twice a second, and only once the imports of torch and torch.distributed have ended: torch's C
    # module is in sys.modules early in `import torch`, and a worker server started then had no recorder handler
    # yet, so the rank fell back to copying in-process and a gloo rank wrote no pace file at all
    while (c10d := sys.modules.get("torch._C._distributed_c10d")) is None \
            or _importing("torch") or _importing("torch.distributed"):
        time.sleep(min(every, 0.5))
    if _serve_recorder(c10d, run_dir, rank, {"every": every, "timed": timed}):
        return
    dump_trace = getattr(c10d, "_dump_nccl_trace", None) or getattr(c10d, "_dump_fr_trace", None)
    if dump_trace is None:
        return
    copying = threading.Lock()   # held while torch's recorder is read: the program's exit waits for it

    def at_exit() -> None:   # never read the recorder while the interpreter (and torch's C++ state) is torn down
        if copying.acquire(timeout=5):
            _PACE_STOPPED.append(True)
            copying.release()
    atexit.register(at_exit)
    while True:
        time.sleep(every - time.time() % every)
        began = time.perf_counter()
        with copying:
            if _PACE_STOPPED:
                return
            try:
                try:
                    raw = dump_trace(True, False, False)
                except TypeError:
                    raw = dump_trace()
                entries = pickle.loads(raw).get("entries") or []
            except Exception:  # noqa: BLE001 - a recorder not enabled, an old torch: try again later
                continue
        rows = flightpace.pace_rows(entries, timed)
        if rows:
            try:
                write_file(path, json.dumps({"time": time.time(), "pid": os.getpid(), "entries": rows,
                                             "copy_ms": round((time.perf_counter() - began) * 1e3, 1)}))
            except OSError:
                return   # the run folder is gone


def _importing(name: str) -> bool:
    """The module is being imported now (it is in sys.modules from the start of its import)."""
    return bool(getattr(getattr(sys.modules.get(name), "__spec__", None), "_initializing", False))


_SERVERS: list = []   # the worker server this process keeps for its life


def _serve_recorder(c10d, run_dir: str, rank: str, settings: dict) -> bool:
    """torch's worker server on flight/rank<R>.sock, its address and JSON dump handlers written to the pace file
    for runctl; False where this torch has no such server or handler (the caller copies in-process)."""
    server_type = getattr(c10d, "_WorkerServer", None)
    if server_type is None:
        return False
    flight, name = os.path.split(os.path.join(run_dir, layout.rank_socket(rank)))
    try:
        dir_fd = os.open(flight, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    _forget(dir_fd, name)   # this rank's earlier process (a restart) left it
    try:
        server = _quietly(lambda: server_type(flightpace.socket_address(dir_fd, name)))
    except Exception:  # noqa: BLE001 - a torch that refuses: copy in-process
        os.close(dir_fd)
        return False
    try:
        handlers = [h for h in flightpace.HANDLERS if h in flightpace.handler_names(dir_fd, name)]
    except (OSError, ValueError):
        handlers = []
    if not handlers:
        _quietly(server.shutdown)
        _forget(dir_fd, name)
        os.close(dir_fd)
        return False
    _SERVERS.append(server)

    def at_exit() -> None:   # before the interpreter's teardown: no request is answered half-way
        _forget(dir_fd, name)
        _quietly(server.shutdown)
    atexit.register(at_exit)
    try:
        write_file(os.path.join(run_dir, layout.rank_pace(rank)),
                   json.dumps(dict(settings, socket=name, handlers=handlers, pid=os.getpid(), time=time.time())))
    except OSError:
        pass   # the run folder is gone: nobody will ask
    return True


def _forget(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def _quietly(call):
    """`call()`, with what is written to stderr meanwhile passed on but for the worker server's own lines
    ("Server listening to UNIX ...", "Server shutting down"): a healthy run's log stays the program's."""
    saved = os.dup(2)
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    try:
        os.dup2(write_end, 2)
        try:
            return call()
        finally:
            os.dup2(saved, 2)
            os.close(write_end)
            written = b""
            try:
                while chunk := os.read(read_end, 65536):
                    written += chunk
            except BlockingIOError:
                pass
            kept = b"".join(line for line in written.splitlines(keepends=True) if b"WorkerServer.cpp" not in line)
            if kept:
                os.write(2, kept)
    finally:
        os.close(read_end)
        os.close(saved)


def _snapshot(folder: str, rank: str) -> dict:
    taken = time.time()   # before anything is read: the answer is as new as this
    names = {t.ident: (t.name, t.native_id) for t in threading.enumerate()}
    me, main = threading.get_ident(), threading.main_thread().ident
    threads = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        name, native = names.get(ident, (f"thread {ident}", None))
        stack = traceback.extract_stack(frame)[-FRAMES_PER_THREAD:]
        threads.append({"name": name, "main": ident == main, "native_id": native,
                        "frames": [[f.filename, f.lineno, f.name, f.line or ""] for f in stack]})
    threads.sort(key=lambda t: not t["main"])
    answer = {"pid": os.getpid(), "time": taken, "threads": threads, "flight": _flight_recorder(folder, rank),
              "listener_tid": threading.get_native_id()}   # its own CPU is not the rank's
    torch = sys.modules.get("torch")
    if torch is not None:
        answer["torch"] = str(getattr(torch, "__version__", "?"))
    return answer


def _flight_recorder(folder: str, rank: str) -> dict:
    """{backend: trimmed dump} for each flight recorder this process has; {} when it never loaded
    torch.distributed (nothing is imported here that the program did not import itself)."""
    c10d = sys.modules.get("torch._C._distributed_c10d")
    if c10d is None:
        return {}
    found = {}
    for backend, name in (("nccl", "_dump_nccl_trace"), ("gloo", "_dump_fr_trace")):
        dump_trace = getattr(c10d, name, None)
        if dump_trace is None:
            continue
        try:
            try:   # without the stack traces: symbolising them costs seconds of CPU on the first dump
                raw = dump_trace(True, False, False)
            except TypeError:
                raw = dump_trace()
            dump = pickle.loads(raw)   # torch's own bytes, from inside this process
        except Exception as exc:  # noqa: BLE001 - an old torch, a recorder not enabled
            found[backend] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        if not isinstance(dump, dict) or not dump.get("entries") and not dump.get("pg_status"):
            continue
        raw_folder = os.path.join(folder, "ondemand")
        os.makedirs(raw_folder, exist_ok=True)
        with open(os.path.join(raw_folder, f"{backend}_rank_{rank}"), "wb") as handle:
            handle.write(raw)
        found[backend] = _trimmed(dump)
    return found


def _trimmed(dump: dict) -> dict:
    entries, kept, seen = dump.get("entries") or [], [], {}
    for entry in reversed(entries):
        group = entry.get("pg_id", entry.get("process_group"))
        key = str(group)
        seen[key] = seen.get(key, 0) + 1
        if seen[key] <= ENTRIES_PER_GROUP or not entry.get("retired", True):
            entry = dict(entry)
            frames = entry.get("frames") or []
            entry["frames"] = [f for f in frames if isinstance(f, dict)][:FRAMES_PER_ENTRY]
            kept.append(entry)
    out = {k: v for k, v in dump.items() if k != "entries"}
    out["entries"] = list(reversed(kept))
    return _plain(out)


def _plain(value):
    """JSON's types only: tuples become lists, anything else its text."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _write_json(path: str, value: dict) -> None:
    try:
        write_file(path, json.dumps(value))
    except OSError:
        pass


def _other_spec():
    import importlib.machinery

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    return importlib.machinery.PathFinder.find_spec("sitecustomize", path)


class _Deferred(type(sys)):
    """What `import sitecustomize` gives a program when only nodectl's ran at start-up: the program's own module,
    loaded on first use from the path as it is then (the script's folder on it)."""

    def __getattr__(self, name: str):
        import importlib.util

        spec = _other_spec()
        if spec is None or spec.loader is None:
            raise AttributeError(f"module 'sitecustomize' has no attribute {name!r}")
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)
        return getattr(module, name)


def _chain() -> None:
    """The sitecustomize this one shadows, if the path has another."""
    import importlib.util

    spec = _other_spec()
    if spec is None or spec.loader is None:
        # none yet: `import sitecustomize` in the program later gives the program's own (beside its script, as
        # without nodectl), found when first used, never this listener
        sys.modules["sitecustomize"] = _Deferred("sitecustomize")
        return
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        # `import sitecustomize` in the program now gives the program's own module, not this one (the import
        # system takes what sys.modules holds once this file has run)
        sys.modules["sitecustomize"] = module
    except Exception as exc:  # noqa: BLE001 - what site.py does with a failing sitecustomize
        print(f"Error in sitecustomize ({spec.origin}); set PYTHONVERBOSE for traceback:\n"
              f"{type(exc).__name__}: {exc}", file=sys.stderr)


try:
    _start()
except Exception:  # noqa: BLE001 - the rank's program runs whatever happens here
    pass
_chain()
