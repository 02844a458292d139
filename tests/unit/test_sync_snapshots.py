"""The snapshots `launch` takes of project files written to while they are sent: a copy each, in a folder of the
temp folder that the process removes when it exits. `kill -9` of a launch left its folder behind (one test's
SIGKILL of a launch syncing a 480 MiB file left 481 MiB in /tmp per run); the next launch removes it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.quick

MAKE_FOLDER = """
import os, sys, time
from pathlib import Path
from nodectl.remote import sync
source = Path(sys.argv[1])
copy, _, _ = sync._snapshot(source)
print(copy.parent, flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), 9)
elif sys.argv[2] == "live":
    time.sleep(60)
"""


def snapshot_in(tmp: str, how: str, source: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "TMPDIR": tmp}
    proc = subprocess.Popen([sys.executable, "-c", MAKE_FOLDER, source, how], env=env, stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def age(path: str, seconds: float) -> None:
    when = time.time() - seconds
    os.utime(path, (when, when))


def test_a_killed_launchs_snapshots_are_removed_by_the_next_and_a_live_ones_kept(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    source = tmp_path / "weights.bin"
    source.write_bytes(os.urandom(1 << 16))

    killed, killed_folder = snapshot_in(str(tmp), "kill", str(source))
    assert killed.wait() == -signal.SIGKILL
    assert len(os.listdir(killed_folder)) == 1   # what a SIGKILL leaves: the copy
    live, live_folder = snapshot_in(str(tmp), "live", str(source))
    killed_now, killed_just_now = snapshot_in(str(tmp), "kill", str(source))
    killed_now.wait()
    older_nodectls = tmp / "nodectl-sync-abc123"   # made by a nodectl before the lock: nobody knows whose
    older_nodectls.mkdir()
    for folder in (killed_folder, live_folder, older_nodectls):
        age(str(folder), 3600)
    try:
        done, own_folder = snapshot_in(str(tmp), "exit", str(source))
        assert done.wait() == 0
        left = sorted(os.listdir(tmp))
        assert os.path.basename(killed_folder) not in left
        assert os.path.basename(live_folder) in left and os.listdir(live_folder)   # its process still sends from it
        assert os.path.basename(killed_just_now) in left   # a minute old at most: maybe not locked yet
        assert older_nodectls.name in left
        assert os.path.basename(own_folder) not in left   # removed at exit, as before
    finally:
        live.kill()
        live.wait()


def test_another_users_snapshot_folder_is_left_alone(tmp_path):
    if os.getuid() != 0:
        pytest.skip("making another user's folder needs root")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    theirs = tmp / "nodectl-snapshots-theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    age(str(theirs), 3600)
    source = tmp_path / "a.txt"
    source.write_text("a")
    done, _ = snapshot_in(str(tmp), "exit", str(source))
    assert done.wait() == 0
    assert theirs.is_dir()
