"""The node-side helper's own rules, on this machine: which processes belong to a run, packing while files
rotate, one identity per workdir storage, a port check that TIME_WAIT does not fool."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

from nodectl.resources import resource_dir

sys.path.insert(0, str(resource_dir("launchers")))
import runctl  # noqa: E402
import runlayout  # noqa: E402


# this file's own run id: its processes carry it, and a stop run by another file's test at the same moment (in
# another worker) looks for its own id; with one id for both, test_shared_node_trust's stop signalled a wrapper here
RUN_ID = "20260101-000000-7e57"


def make_run(tmp_path, run_id=RUN_ID, node_rank=0):
    run_dir = tmp_path / "run"
    for name in runlayout.FOLDERS:
        (run_dir / name).mkdir(parents=True, exist_ok=True)
    (run_dir / "node.json").write_text(json.dumps({"run_id": run_id, "node_rank": node_rank, "ranks": [0]}))
    return run_dir


def sleeper(env_extra: dict) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NODECTL_")}
    return subprocess.Popen(["sleep", "60"], env={**env, **env_extra}, start_new_session=True)


def test_only_processes_carrying_the_run_id_belong_and_a_reused_group_is_left_alone(tmp_path):
    run_dir = make_run(tmp_path)
    ours = sleeper({"NODECTL_RUN_ID": RUN_ID, "NODECTL_NODE_RANK": "0"})
    other_rank = sleeper({"NODECTL_RUN_ID": RUN_ID, "NODECTL_NODE_RANK": "1"})
    stranger = sleeper({})
    try:
        # As after a reboot: the recorded group number now names a stranger's group, launch.sh never exited.
        (run_dir / "state" / "pgid").write_text(str(os.getpgid(stranger.pid)))
        assert runctl.processes.run_processes(str(run_dir)) == [ours.pid]
        answer = runctl.stop.cmd_stop([str(run_dir)], {"grace": 2})
        assert answer["terminated"] == 1 and answer["left"] == 0
        assert ours.wait(5) is not None
        assert stranger.poll() is None and other_rank.poll() is None
        assert not runctl.processes.signal_run_process(stranger.pid, 15, runctl.processes.run_markers(str(run_dir)))
        assert stranger.poll() is None
    finally:
        for proc in (ours, other_rank, stranger):
            proc.kill()
            proc.wait()


def test_pack_survives_checkpoints_rotating_underneath(tmp_path):
    run_dir = make_run(tmp_path)
    (run_dir / "logs" / "rank0.log").write_text("hello\n")
    (run_dir / "code").mkdir(exist_ok=True)
    (run_dir / "code" / "train.py").write_text("print()\n")
    (run_dir / "env.sh").write_text("HF_TOKEN=secret\n")
    (run_dir / "output" / "adapter-5").mkdir()
    (run_dir / "output" / "adapter-5" / "adapter_model.safetensors").write_bytes(b"weights")
    os.symlink("adapter-5", run_dir / "output" / "adapter")
    stop = threading.Event()

    def rotate():
        step = 0
        while not stop.is_set():
            folder = run_dir / "output" / "checkpoints" / f"ckpt-{step}"
            folder.mkdir(parents=True)
            for i in range(20):
                (folder / f"shard{i}.pt").write_bytes(b"x" * 2048)
            old = run_dir / "output" / "checkpoints" / f"ckpt-{step - 1}"
            if old.exists():
                for path in old.iterdir():
                    path.unlink()
                old.rmdir()
            step += 1

    thread = threading.Thread(target=rotate)
    thread.start()
    try:
        for _ in range(40):
            answer = runctl.collect.cmd_pack([str(run_dir)], {})
            assert answer["entries"] > 0
    finally:
        stop.set()
        thread.join()
    with tarfile.open(answer["archive"]) as tar:
        names = tar.getnames()
    assert "logs/rank0.log" in names and "node.json" in names and "output/adapter" in names
    assert "output/adapter-5/adapter_model.safetensors" in names
    assert not any(n.startswith("code") or n == "env.sh" for n in names)  # no code, no secrets


def test_one_identity_per_workdir_storage(tmp_path):
    first = runctl.store.cmd_identity([str(tmp_path / "work")], {})["identity"]
    assert runctl.store.cmd_identity([str(tmp_path / "work")], {})["identity"] == first
    os.symlink(tmp_path / "work", tmp_path / "link")
    assert runctl.store.cmd_identity([str(tmp_path / "link")], {})["identity"] == first  # the same disk, other path
    assert runctl.store.cmd_identity([str(tmp_path / "other")], {})["identity"] != first


def test_port_in_time_wait_counts_as_free_like_for_the_tcp_store():
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        port = server.getsockname()[1]
        server.listen()
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the server side closes first: its end sits in TIME_WAIT
        client.close()
    time.sleep(0.1)
    assert runctl.net.cmd_port([str(port)], {})["free"]


def test_a_taken_port_is_replaced_by_one_no_outgoing_connection_can_take_first():
    """The port offered for a taken one (and for 0) lies outside the kernel's ephemeral range, from which every
    outgoing connection (the ranks' own) draws: a port from bind(0) was taken before torchrun's store listened."""
    import ports

    low, high = ports.ephemeral_range()
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        answer = runctl.net.cmd_port([str(taken)], {})
        chosen = runctl.net.cmd_port(["0"], {})
    assert answer["free"] is False and answer["asked"] == taken
    for port in (answer["port"], chosen["port"]):
        assert not low <= port <= high and port >= ports.LOWEST
        with socket.socket() as store:     # the store can listen there, on every address
            store.bind(("", port))
            store.listen()


@pytest.mark.parametrize("unpacker", ["tar", "tarfile"])  # the node's tar, or Python's where it has none
def test_store_and_run_files_are_private_whatever_the_source_mode(tmp_path, monkeypatch, unpacker):
    import hashlib
    import io
    import types

    secret, script = b"aws_secret_access_key = abc\n", b"#!/bin/sh\necho hi\n"
    upload = io.BytesIO()
    with tarfile.open(fileobj=upload, mode="w|") as tar:
        for data in (secret, script):
            info = tarfile.TarInfo(hashlib.sha256(data).hexdigest())
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    workdir, run_dir = tmp_path / "work", tmp_path / "work" / "runs" / "r1"
    if unpacker == "tarfile":
        monkeypatch.setenv("NODECTL_NO_TAR", "1")
    monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(buffer=io.BytesIO(upload.getvalue())))
    assert runctl.store.cmd_receive([str(workdir)], {}) == {"received": 2, "bytes": len(secret) + len(script)}
    request = {"workdir": str(workdir), "run_dir": str(run_dir), "rendered": {},
               "files": [{"path": "code/credentials.ini", "sha256": hashlib.sha256(secret).hexdigest(), "mode": 0o644},
                         {"path": "code/bin/run.sh", "sha256": hashlib.sha256(script).hexdigest(), "mode": 0o755}]}
    runctl.runfolder.cmd_prepare([], request)
    store = workdir / ".nodectl" / "objects"
    assert oct(store.stat().st_mode & 0o777) == "0o700"
    assert {oct(p.stat().st_mode & 0o777) for p in store.iterdir()} == {"0o600"}
    assert oct((run_dir / "code" / "credentials.ini").stat().st_mode & 0o777) == "0o600"
    assert oct((run_dir / "code" / "bin" / "run.sh").stat().st_mode & 0o777) == "0o700"
    assert oct(run_dir.stat().st_mode & 0o777) == "0o700"
    assert sorted(p.name for p in store.iterdir()) == sorted(hashlib.sha256(d).hexdigest() for d in (secret, script))


def test_a_code_file_changed_in_place_by_its_run_never_reaches_the_next_run(tmp_path, monkeypatch):
    """Run folders share the store's bytes (one write per byte on the node); a program that rewrites its own
    code file in place must not hand the changed bytes to a later run under the old content's hash."""
    import hashlib
    import io
    import types

    data = b"LEARNING_RATE = 3e-4\n" * 100
    sha = hashlib.sha256(data).hexdigest()

    def receive():
        upload = io.BytesIO()
        with tarfile.open(fileobj=upload, mode="w|") as tar:
            info = tarfile.TarInfo(sha)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(buffer=io.BytesIO(upload.getvalue())))
        runctl.store.cmd_receive([str(workdir)], {})

    def prepare(run):
        runctl.runfolder.cmd_prepare([], {"workdir": str(workdir), "run_dir": str(workdir / "runs" / run), "rendered": {},
                                "files": [{"path": "code/config.py", "sha256": sha, "mode": 0o644}]})
        return workdir / "runs" / run / "code" / "config.py"

    workdir = tmp_path / "work"
    have = {"hashes": [sha], "sizes": {sha: len(data)}}
    assert runctl.store.cmd_have([str(workdir)], have)["missing"] == [sha]
    receive()
    assert runctl.store.cmd_have([str(workdir)], have)["missing"] == []
    first = prepare("r1")
    assert first.read_bytes() == data
    with open(first, "r+b") as handle:  # the run edits its own file in place, same size
        handle.write(b"LEARNING_RATE = 9e-9")
    assert runctl.store.cmd_have([str(workdir)], have)["missing"] == [sha]  # the store's object is no longer trusted
    receive()
    assert prepare("r2").read_bytes() == data
    assert first.read_bytes().startswith(b"LEARNING_RATE = 9e-9")  # r1 keeps what it wrote
    # the audit's version: the same edit with the mtime put back (size unchanged): the content is what counts
    second = workdir / "runs" / "r2" / "code" / "config.py"
    before = second.stat()
    with open(second, "r+b") as handle:
        handle.write(b"LEARNING_RATE = 9e-9")
    os.utime(second, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert second.stat().st_mtime_ns == before.st_mtime_ns and second.stat().st_size == before.st_size
    assert runctl.store.cmd_have([str(workdir)], have)["missing"] == [sha]
    receive()
    assert prepare("r3").read_bytes() == data


@pytest.fixture(scope="module")
def six_wheel(tmp_path_factory):
    """six's wheel from this machine's package index (its pip configuration), once."""
    folder = tmp_path_factory.mktemp("wheels")
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                           "six==1.17.0", "-d", str(folder)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"no package index here: {proc.stderr[-300:]}")
    return next(folder.glob("six-*.whl"))


def _import_six(answer: dict) -> str:
    return subprocess.run([answer["python_path"], "-c", "import six; print(six.__version__)"], capture_output=True,
                          text=True, check=True).stdout.strip()


def test_a_venv_from_wheels_with_pip_then_from_a_node_index_and_drift_is_caught(tmp_path, six_wheel):
    """The two builds that do not use uv: the interpreter's venv and pip from wheels in the object store (a node
    with no uv wheel for its platform), and `install: index` (the node's own index; here a file:// one)."""
    workdir = tmp_path / "work"
    store = workdir / ".nodectl" / "objects"
    store.mkdir(parents=True)
    sha = runctl.store._hash_file(str(six_wheel))
    (store / sha).write_bytes(six_wheel.read_bytes())
    request = {"lock_sha": "1" * 64, "wheels": [{"name": six_wheel.name, "sha256": sha}]}
    built = runctl.envs.cmd_env_build([str(workdir)], request)
    assert built["installer"] == "pip" and built["intact"] and built["reused"] is False
    assert _import_six(built) == "1.17.0"
    assert runctl.envs.cmd_env_build([str(workdir)], request)["reused"] is True

    site = next(Path(built["python_path"]).parent.parent.glob("lib/python3*/site-packages"))
    (site / "six.py").write_text((site / "six.py").read_text() + "\n# by hand\n")
    (site / "extra.py").write_text("")
    status = runctl.envs.cmd_env_status([str(workdir)], {"lock_sha": "1" * 64})
    assert status["present"] and not status["intact"]
    env_path = Path(status["path"])
    assert status["changed"] == [str((site / "six.py").relative_to(env_path))]
    assert status["added"] == [str((site / "extra.py").relative_to(env_path))]
    uv_cache = workdir / ".nodectl" / "uv-cache"
    (uv_cache / "unpacked").mkdir(parents=True)   # what uv unpacked for the first build
    again = runctl.envs.cmd_env_build([str(workdir)], request)
    assert again["reused"] is False and again["replaced"].endswith(".drifted") and again["intact"]
    assert "# by hand" not in (site / "six.py").read_text()
    # the venv's files were copies: the edit never reached uv's cache, which stays for the rebuild to use
    assert (uv_cache / "unpacked").is_dir()
    # a venv of an older nodectl (hard links into the cache, a manifest without a version) that drifted: the
    # cache may hold the changed bytes, and goes
    (env_path / "nodectl-manifest.json").write_text("{}")
    legacy = runctl.envs.cmd_env_build([str(workdir)], request)
    assert legacy["reused"] is False and legacy["intact"] and not uv_cache.exists()

    index = tmp_path / "simple" / "six"
    index.mkdir(parents=True)
    (index / six_wheel.name).write_bytes(six_wheel.read_bytes())
    (index / "index.html").write_text(f'<a href="{six_wheel.name}">{six_wheel.name}</a>\n')
    online = runctl.envs.cmd_env_build([str(workdir)], {"lock_sha": "2" * 64, "index": f"file://{tmp_path}/simple",
                                                   "requirements": "six==1.17.0\n"})
    assert online["installer"] == "pip (node's index)" and _import_six(online) == "1.17.0"
    assert online["key"] != built["key"]


def test_a_wrapper_killed_with_sigkill_takes_its_rank_with_it(tmp_path):
    """A rank whose wrapper (lib/rankexec.py) is SIGKILLed, by hand or by the OOM killer, used to train on as an
    orphan: torchrun, seeing its worker gone, ended the attempt, and the orphan went on writing steps and a
    checkpoint into the output folder the next attempt continues from. It now dies with its wrapper."""
    import signal

    run_dir = make_run(tmp_path)
    wrapper = _real_wrapper(run_dir, "import time\nwhile True:\n    time.sleep(0.05)\n")
    child = None
    try:
        child = _its_rank(run_dir, wrapper)
        assert _lives(child)
        os.kill(wrapper.pid, signal.SIGKILL)
        wrapper.wait(10)
        deadline = time.time() + 10
        while _lives(child):
            assert time.time() < deadline, "the rank outlived its killed wrapper"
            time.sleep(0.02)
    finally:
        wrapper.kill()
        wrapper.wait()
        if child and _lives(child):
            os.kill(child, signal.SIGKILL)


def _real_wrapper(run_dir, program: str) -> subprocess.Popen:
    """lib/rankexec.py running `program` as rank 0 of the run in `run_dir`, in a session of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NODECTL_")}
    env.update(NODECTL_RUN_ID=RUN_ID, NODECTL_NODE_RANK="0", NODECTL_RUN_DIR=str(run_dir), RANK="0")
    return subprocess.Popen([sys.executable, str(resource_dir("launchers") / "rankexec.py"), "-c", program],
                            env=env, start_new_session=True)


def _its_rank(run_dir, wrapper: subprocess.Popen) -> int:
    """The pid the wrapper recorded for its rank, once it has."""
    pid_file, deadline = run_dir / runlayout.rank_pid(0), time.time() + 30
    while not (pid_file.exists() and pid_file.read_text().strip()):
        assert time.time() < deadline and wrapper.poll() is None
        time.sleep(0.02)
    return int(pid_file.read_text())


def _lives(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not runctl.processes.is_zombie(pid)


def test_a_rank_that_ended_while_its_wrapper_writes_the_exit_is_never_called_killed(tmp_path):
    """`status` polled as a run ended said `killed` of a rank that exited 0: the rank was gone (reaped) and its
    exit record not yet written. The window is held open here: the real wrapper (lib/rankexec.py) is stopped
    while its rank ends. Seen then, the rank is ending (shown running); once the wrapper goes on, exited(0)."""
    import signal

    from nodectl.cli.status import _rank_state
    from nodectl.remote.answers import PollAnswer, RankState

    run_dir = make_run(tmp_path)
    go = tmp_path / "go"
    wrapper = _real_wrapper(run_dir, f"import os, time\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.02)\n")
    markers = runctl.processes.run_markers(str(run_dir))
    try:
        deadline = time.time() + 30
        child = _its_rank(run_dir, wrapper)
        assert runctl.watch.rank_state(str(run_dir), 0, time.time(), markers)["alive"]
        os.kill(wrapper.pid, signal.SIGSTOP)   # it cannot reap its rank nor write the exit record
        go.touch()
        while not runctl.processes.is_zombie(child):
            assert time.time() < deadline
            time.sleep(0.02)
        seen = runctl.watch.rank_state(str(run_dir), 0, time.time(), markers)
        assert not seen["alive"] and seen["exit"] is None and seen.get("ending"), seen
        poll = PollAnswer(now=time.time(), node_rank=0, alive=1, ranks=(), started=True, same_boot=True)
        shown = _rank_state(RankState(rank=0, pid=child, alive=False, ending=True), poll, 60)
        assert shown["state"] == "running", shown
        assert _rank_state(RankState(rank=0, pid=child, alive=False), poll, 60)["state"] == "killed"  # no wrapper
        os.kill(wrapper.pid, signal.SIGCONT)
        assert wrapper.wait(10) == 0
        done = runctl.watch.rank_state(str(run_dir), 0, time.time(), markers)
        assert done["exit"]["code"] == 0 and not done.get("ending"), done
    finally:
        os.kill(wrapper.pid, signal.SIGCONT) if wrapper.poll() is None else None
        wrapper.kill()
        wrapper.wait()


def test_ranks_ending_normally_under_a_poll_every_20ms_are_never_shown_killed(tmp_path):
    """The issue's check, tighter: 20 ranks (the real wrapper, lib/rankexec.py) end with exit 0 at moments spread
    over many rounds of reads, while their state is read again and again, 20 ms apart, the way `status` reads it
    (runctl's poll answer through nodectl's parser, then status's row); not one read says `killed`, each rank is
    seen alive and then ended, and each ends as exited(0). Each rank ends a moment after the round of reads that
    releases it, so a loaded machine that reads slowly still reads across every ending."""
    import random

    from nodectl.cli.status import _rank_state
    from nodectl.remote.answers import parse

    env = {k: v for k, v in os.environ.items() if not k.startswith("NODECTL_")}
    rng = random.Random(7)
    runs, release = [], []
    for i in range(20):
        run_dir = make_run(tmp_path / f"r{i}", run_id=f"20260101-000000-{i:04d}")
        gate = tmp_path / f"release-{i}"
        program = (f"import os, time\nwhile not os.path.exists({str(gate)!r}):\n    time.sleep(0.005)\n"
                   f"time.sleep({rng.uniform(0.0, 0.3):.3f})\n")
        wrapper = subprocess.Popen([sys.executable, str(resource_dir("launchers") / "rankexec.py"), "-c", program],
                                   env={**env, "NODECTL_RUN_ID": f"20260101-000000-{i:04d}", "NODECTL_NODE_RANK": "0",
                                        "NODECTL_RUN_DIR": str(run_dir), "RANK": "0"}, start_new_session=True)
        runs.append((run_dir, wrapper, runctl.processes.run_markers(str(run_dir))))
        release.append((rng.randint(1, 12), gate))
        # as runctl start leaves a run: its process group and the boot it started in
        (run_dir / runlayout.PGID).write_text(str(wrapper.pid))
        (run_dir / runlayout.BOOT).write_text(runctl.common.boot_id() or "")
    deadline = time.time() + 120
    seen: list[list[str]] = [[] for _ in runs]

    def shown(run_dir) -> str:   # runctl's poll answer, read through nodectl's parser, as `status` shows it
        answer = parse("poll", runctl.watch.cmd_poll([str(run_dir)], {}))
        return _rank_state(answer.ranks[0], answer, 60)["state"]

    try:
        round_ = 0
        while any(w.poll() is None for _, w, _ in runs) and time.time() < deadline:
            round_ += 1
            for states, (run_dir, _, _) in zip(seen, runs):
                states.append(shown(run_dir))
            for after, gate in release:   # after the round's reads: each rank is read alive at least once
                if after == round_:
                    gate.touch()
            time.sleep(0.02)
        assert all(w.wait(10) == 0 for _, w, _ in runs)
        final = [shown(run_dir) for run_dir, _, _ in runs]
    finally:
        for _, wrapper, _ in runs:
            wrapper.kill()
            wrapper.wait()
    every = [state for states in seen for state in states]
    assert "killed" not in every, {state: every.count(state) for state in set(every)}
    # every ending was read across: each rank shown alive before its release, then ended
    assert all(states[0] != "exited(0)" for states in seen), seen
    assert sum("exited(0)" in states for states in seen) >= 15, seen   # most ranks ended while others were read
    assert final == ["exited(0)"] * 20, final


def test_a_watch_stream_sends_a_ranks_end_at_once_not_at_its_next_line(tmp_path):
    """A crash is news: the node's watcher (runctl watch, the stream the controller reads) sends a line as soon as
    a rank's wrapper records its end, not at the end of its interval (60 s here), and that line carries the exit."""
    run_dir = make_run(tmp_path)
    gate = tmp_path / "end-now"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NODECTL_")}
    program = f"import os, sys, time\nwhile not os.path.exists({str(gate)!r}):\n    time.sleep(0.01)\nsys.exit(3)\n"
    wrapper = subprocess.Popen([sys.executable, str(resource_dir("launchers") / "rankexec.py"), "-c", program],
                               env={**env, "NODECTL_RUN_ID": RUN_ID, "NODECTL_NODE_RANK": "0",
                                    "NODECTL_RUN_DIR": str(run_dir), "RANK": "0"}, start_new_session=True)
    (run_dir / runlayout.PGID).write_text(str(wrapper.pid))
    watch = ("import sys\nsys.path.insert(0, sys.argv[1])\nfrom runctl.watch import cmd_watch\n"
             "cmd_watch([sys.argv[2]], {'interval': 60})\n")
    watcher = subprocess.Popen([sys.executable, "-c", watch, str(resource_dir("launchers")), str(run_dir)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        first = json.loads(watcher.stdout.readline())
        assert first["seq"] == 1 and first["ranks"][0]["exit"] is None
        ended = time.monotonic()
        gate.touch()
        second = json.loads(watcher.stdout.readline())
        took = time.monotonic() - ended
        assert wrapper.wait(10) == 3
    finally:
        wrapper.kill()
        watcher.kill()
        watcher.wait()
    assert second["seq"] == 2 and second["ranks"][0]["exit"]["code"] == 3, second["ranks"]
    assert took < 20, took   # the interval is 60 s


def test_the_busiest_processes_not_the_runs_are_told_with_their_share_of_a_cpu(tmp_path, monkeypatch):
    """What a rank waiting for a CPU waits on: a spinning process of someone else's is told (pid, name, share);
    one of the run's own, spinning as hard, is not. (Every process past a small share is told here: beside the
    rest of the suite the two spinners need not be the busiest three.)"""
    import runctl.pace

    monkeypatch.setattr(runctl.pace, "OTHERS_SHOWN", 1000)
    monkeypatch.setattr(runctl.pace, "OTHERS_SHARE", 0.02)
    run_dir = make_run(tmp_path)
    spin = "import time\nend = time.time() + 20\nwhile time.time() < end:\n    pass\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NODECTL_")}
    hog = subprocess.Popen([sys.executable, "-c", spin], env=env)
    ours = subprocess.Popen([sys.executable, "-c", spin],
                            env={**env, "NODECTL_RUN_ID": RUN_ID, "NODECTL_NODE_RANK": "0"})
    time.sleep(0.5)   # both started (between fork and exec a child still has this process's environment)
    try:
        runctl.pace._CPU_SEEN.clear()
        first = runctl.pace.busiest_others(runctl.processes.run_markers(str(run_dir)))   # a one-shot: two looks
        time.sleep(1.0)
        later = runctl.pace.busiest_others(runctl.processes.run_markers(str(run_dir)))   # since the first
        for told in (first, later):
            mine = [o for o in told if o["pid"] == hog.pid]
            assert mine and mine[0]["name"].startswith("python"), told
            assert mine[0]["share"] >= 0.1, told   # two spinners on 2 cores beside the suite: a share, not 1.0
            assert ours.pid not in [o["pid"] for o in told]
    finally:
        for proc in (hog, ours):
            proc.kill()
            proc.wait()


def test_the_newest_complete_checkpoint_is_the_one_a_restart_continues_from(tmp_path):
    """poll's `checkpoint`: the built-in trainer's newest checkpoint holding COMPLETE (written last); one being
    written (.ckpt-*.tmp) or cut short (no COMPLETE) is not it, nor a link that leads out of the run folder."""
    run_dir = make_run(tmp_path)
    folder = run_dir / "output" / "checkpoints"
    for step, complete in ((5, True), (10, True), (15, False)):
        (folder / f"ckpt-{step:07d}").mkdir(parents=True)
        if complete:
            (folder / f"ckpt-{step:07d}" / "COMPLETE").write_text("{}")
    (folder / ".ckpt-0000020.tmp").mkdir()
    elsewhere = tmp_path / "elsewhere" / "ckpt-0000025"
    elsewhere.mkdir(parents=True)
    (elsewhere / "COMPLETE").write_text("{}")
    (folder / "ckpt-0000025").symlink_to(elsewhere)
    answer = runctl.watch.cmd_poll([str(run_dir)], {"checkpoint": True})
    assert answer["checkpoint"] == 10, answer
    assert "checkpoint" not in runctl.watch.cmd_poll([str(run_dir)], {})   # asked for only at a restart
    empty = make_run(tmp_path / "other")
    assert runctl.watch.cmd_poll([str(empty)], {"checkpoint": True})["checkpoint"] is None
