"""A rank's pace read out of its process (launchers/flightpace.py): the rank serves its flight recorder through
torch's worker server, runctl reads it from another process at most every pace interval, nothing about it shows in
the rank's log, nothing is left behind, and a link planted in its place is never followed. A torch without the
server keeps the in-process copy."""
from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from support.trainer import free_port

LAUNCHERS = Path(__file__).resolve().parents[2] / "launchers"

PROGRAM = """\
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
tensor = torch.ones(1000)
for _ in range(50):
    dist.all_reduce(tensor)
print("reduced", flush=True)
while not os.path.exists(sys.argv[2]):
    time.sleep(0.05)
dist.destroy_process_group()
"""


@pytest.fixture
def runctl_path(monkeypatch):
    monkeypatch.syspath_prepend(str(LAUNCHERS))   # runctl, runlayout, nodeio, flightpace: as in runctl's artifact


def wait_for(predicate, what: str, seconds: float = 60):
    deadline = time.time() + seconds
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"no {what} in {seconds} s")


def start_rank(tmp_path: Path, every: str = "1"):
    run_dir = tmp_path / "run"
    (run_dir / "flight").mkdir(parents=True)
    os.mkfifo(run_dir / "flight" / "rank0.request")
    (tmp_path / "program.py").write_text(PROGRAM)
    env = {**os.environ, "NODECTL_RANK_HELPER": str(run_dir / "flight" / "rank0.request"),
           "NODECTL_RUN_DIR": str(run_dir), "RANK": "0", "NODECTL_PACE_EVERY": every,
           "TORCH_FR_BUFFER_SIZE": "2000", "PYTHONPATH": str(LAUNCHERS)}
    proc = subprocess.Popen([sys.executable, "-u", str(tmp_path / "program.py"), str(free_port()),
                             str(tmp_path / "done")], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path)
    return proc, run_dir


def served(run_dir: Path):
    try:
        record = json.loads((run_dir / "flight" / "rank0.pace.json").read_text())
    except (OSError, ValueError):
        return None
    return record if record.get("socket") else None


@pytest.mark.slow
def test_runctl_reads_the_ranks_recorder_from_outside_and_the_rank_shows_nothing_of_it(tmp_path, runctl_path):
    from runctl.pace import rank_pace

    proc, run_dir = start_rank(tmp_path)
    try:
        assert proc.stdout.readline().strip() == "reduced"
        record = wait_for(lambda: served(run_dir), "served pace record")
        assert record["socket"] == "rank0.sock" and record["pid"] == proc.pid and record["every"] == 1.0
        assert "fr_trace_json" in record["handlers"]

        answer = rank_pace(str(run_dir), 0, proc.pid, 0)
        assert len(answer["seqs"]) == 50 and answer["seqs"] == sorted(answer["seqs"])
        assert set(answer["kinds"]) == {"allreduce"} and set(answer["moved"]) == {4000}   # 1000 floats
        kept = json.loads((run_dir / "flight" / "rank0.pace.json").read_text())
        assert len(kept["entries"]) == 50 and kept["copied"] > record["time"]

        # within the rank's pace interval a second poll reads the kept rows, not the rank
        (run_dir / "flight" / "rank0.sock").rename(run_dir / "flight" / "away.sock")
        assert rank_pace(str(run_dir), 0, proc.pid, 0)["seqs"] == answer["seqs"]
        time.sleep(1.1)   # past it, with no server to ask: the last rows stand
        assert rank_pace(str(run_dir), 0, proc.pid, answer["reached"][24])["seqs"] == answer["seqs"][25:]
        (run_dir / "flight" / "away.sock").rename(run_dir / "flight" / "rank0.sock")
    finally:
        (tmp_path / "done").touch()
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "WorkerServer" not in err and "Server" not in err, err   # the rank's log is the program's
    assert not (run_dir / "flight" / "rank0.sock").exists()          # gone with the rank


@pytest.mark.slow
def test_a_link_planted_as_the_ranks_socket_is_not_followed(tmp_path, runctl_path):
    from runctl.pace import rank_pace

    proc, run_dir = start_rank(tmp_path)
    decoy_path = tmp_path / "decoy.sock"
    decoy = socket.socket(socket.AF_UNIX)
    decoy.bind(str(decoy_path))
    decoy.listen()
    decoy.settimeout(0.5)
    try:
        assert proc.stdout.readline().strip() == "reduced"
        wait_for(lambda: served(run_dir), "served pace record")
        first = rank_pace(str(run_dir), 0, proc.pid, 0)
        assert len(first["seqs"]) == 50
        sock = run_dir / "flight" / "rank0.sock"
        sock.rename(run_dir / "flight" / "real.sock")
        sock.symlink_to(decoy_path)   # a rank (or a container's root) points it at another program's socket
        time.sleep(1.1)
        assert rank_pace(str(run_dir), 0, proc.pid, 0)["seqs"] == first["seqs"]   # the last rows stand
        with pytest.raises(TimeoutError):
            decoy.accept()   # runctl never connected to it
    finally:
        decoy.close()
        (tmp_path / "done").touch()
        proc.communicate(timeout=60)


def test_a_torch_without_the_worker_server_copies_in_process_at_shared_ticks(tmp_path, monkeypatch):
    """torch's surface before the worker server's JSON handlers: only the Python dump (a pickle)."""
    import importlib.util

    monkeypatch.syspath_prepend(str(LAUNCHERS))
    monkeypatch.delenv("NODECTL_RUN_DIR", raising=False)
    spec = importlib.util.spec_from_file_location("listener_under_test", LAUNCHERS / "sitecustomize.py")
    listener = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(listener)   # outside a run: defines, starts nothing
    entries = [{"pg_id": 0, "collective_seq_id": n, "time_created_ns": 1_000 + n, "profiling_name": "gloo:all_reduce",
                "input_sizes": [[10]], "input_dtypes": ["Float"], "state": "completed", "is_p2p": False}
               for n in range(1, 31)]
    copies = []

    def dump(*_):
        copies.append(time.time())
        return pickle.dumps({"entries": entries})
    monkeypatch.setitem(sys.modules, "torch._C._distributed_c10d", types.SimpleNamespace(_dump_fr_trace=dump))
    run_dir = tmp_path / "run"
    (run_dir / "flight").mkdir(parents=True)
    threading.Thread(target=listener._keep_pace, args=(str(run_dir), "0", 0.5), daemon=True).start()
    pace = run_dir / "flight" / "rank0.pace.json"
    record = wait_for(lambda: pace.exists() and json.loads(pace.read_text()), "pace file", 10)
    assert "socket" not in record and [row[1] for row in record["entries"]] == list(range(1, 31))
    assert record["entries"][0][4:] == [40, "allreduce"]
    wait_for(lambda: len(copies) >= 3, "three copies", 10)
    listener._PACE_STOPPED.append(True)
    assert all(abs(at % 0.5) < 0.1 or abs(at % 0.5 - 0.5) < 0.1 for at in copies), copies   # on the ticks


def _hostile_server(path: Path, kind: str) -> threading.Thread:
    """A unix socket posing as a rank's worker server: a 3 GB body, a body dripped a byte at a time, or JSON nested
    100,000 deep (round four: the first grew runctl to 2.6 GB, the others turned a running node into "lost")."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def serve() -> None:
        peer, _ = listener.accept()
        with peer:
            peer.recv(65536)
            try:
                if kind == "huge":
                    peer.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 3000000000\r\n\r\n")
                    block = b"x" * (1 << 20)
                    for _ in range(3000):
                        peer.sendall(block)
                elif kind == "drip":
                    peer.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
                    for _ in range(1000):
                        peer.sendall(b" ")
                        time.sleep(0.5)
                else:
                    body = b"[" * 100_000 + b"]" * 100_000
                    peer.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            except OSError:   # the reader hung up: what it should do
                pass
        listener.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("kind, timeout, words", [("huge", 60.0, "over 64 MiB"), ("drip", 2.0, "did not answer within 2 s"),
                                                  ("deep", 30.0, "nested too deep")])
def test_a_rank_serving_a_hostile_answer_costs_its_pace_row_alone(tmp_path, runctl_path, kind, timeout, words):
    import flightpace
    import psutil

    _hostile_server(tmp_path / "rank0.sock", kind)
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    before, began = psutil.Process().memory_info().rss, time.monotonic()
    try:
        with pytest.raises(ValueError, match=words):
            flightpace.fetch(dir_fd, "rank0.sock", "fr_trace_json", timeout=timeout)
    finally:
        os.close(dir_fd)
    assert time.monotonic() - began < timeout + 5
    assert psutil.Process().memory_info().rss - before < 256 << 20
