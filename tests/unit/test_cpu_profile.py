"""tests/support/cpu_profile.py: the suite's CPU test by test (a developer's tool for the suite's time)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

BUSY = '''\
import time


def test_busy():
    until = time.process_time() + 0.4
    while time.process_time() < until:
        pass


def test_idle():
    time.sleep(0.3)
'''


def test_each_test_gets_its_cpu_and_wall_seconds_and_each_file_a_total(tmp_path):
    (tmp_path / "test_sample.py").write_text(BUSY)
    kept = tmp_path / "profile.jsonl"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "support.cpu_profile", "-p",
                           "no:cacheprovider", "-o", "addopts=", "--rootdir", str(tmp_path), str(tmp_path)],
                          cwd=TESTS, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NODECTL_CPU_PROFILE": str(kept), "PYTHONPATH": str(TESTS)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = {row["test"].rsplit("::", 1)[1]: row for row in map(json.loads, kept.read_text().splitlines())}
    assert set(rows) == {"test_busy", "test_idle"}
    assert rows["test_busy"]["cpu_s"] >= 0.35 and rows["test_busy"]["wall_s"] >= 0.35, rows
    assert rows["test_idle"]["wall_s"] >= 0.3, rows   # its CPU is the machine's: other work counts (no bound)
    assert "CPU seconds by file (machine-wide, 2 tests" in done.stdout
    assert "2 test(s)  test_sample.py" in done.stdout, done.stdout
