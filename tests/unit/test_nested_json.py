"""Deeply nested JSON from a node or in a record (issue 40: RecursionError tracebacks in runctl's and the
controller's readers) is malformed input: a node answer that is no answer, a record that is unreadable."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nodectl.errors import UsageError
from nodectl.remote.agent import last_json
from nodectl.runs import Run

DEEP = "[" * 100_000 + "]" * 100_000
LAUNCHERS = Path(__file__).resolve().parents[2] / "launchers"


def test_a_node_answer_nested_too_deep_is_no_answer():
    assert last_json('{"a": ' + DEEP + "}") is None
    assert last_json('{"ok": 1}\n{"a": ' + DEEP + "}") == {"ok": 1}


def test_a_run_record_nested_too_deep_is_unreadable_not_a_traceback(tmp_path):
    (tmp_path / "20260101-000000-deep").mkdir()
    (tmp_path / "20260101-000000-deep" / "manifest.json").write_text('{"plan": ' + DEEP + "}")
    with pytest.raises(UsageError, match="manifest unreadable"):
        Run(tmp_path / "20260101-000000-deep").read()


@pytest.mark.parametrize("request_text", ['{"a": ' + DEEP + "}", "[1, 2]"])
def test_runctl_answers_a_malformed_request_with_an_error(tmp_path, request_text):
    proc = subprocess.run([sys.executable, "-m", "runctl", "poll", str(tmp_path)], input=request_text,
                          capture_output=True, text=True, timeout=60, cwd=LAUNCHERS)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-500:]
    assert json.loads(proc.stdout.splitlines()[-1]) == {"error": "poll: malformed request ("
                                                       f"{'RecursionError' if 'a' in request_text else 'ValueError'})"}
