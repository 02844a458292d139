"""One rule from per-node outcomes to the exit code (nodectl.errors.exit_code_for), the same in every command that
acts on a recorded run: a node that answered with an error is exit 1, a node that could not be reached exit 3."""
from __future__ import annotations

import json
import os

import pytest

from nodectl.errors import EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE, exit_code_for
from nodectl.inventory import parse_inventory
from nodectl.launch.job import JobSpec, plan_job, record_job
from nodectl.transport import NodeResult
from support.cli import CLIResult, nodectl_in


def test_the_rule():
    node = parse_inventory("nodes: [{host: a}, {host: b}]", "hosts.yaml").nodes
    ok, answered, gone = NodeResult(node[0], value={}), NodeResult.failed(node[0], "no run"), \
        NodeResult.failed(node[1], "refused", "unreachable")
    assert exit_code_for([ok, ok]) == EXIT_OK
    assert exit_code_for([ok, answered]) == EXIT_FAILED
    assert exit_code_for([answered, gone]) == EXIT_UNREACHABLE
    assert exit_code_for([]) == EXIT_OK


def recorded_run(tmp_path, inventory_text: str) -> str:
    """A run recorded through the launch pipeline whose folder exists on no node (never started)."""
    os.chdir(tmp_path)
    inventory = parse_inventory(inventory_text, "hosts.yaml")
    return record_job(plan_job(JobSpec(inventory, command=("x.py",), sync_dir=".", files=()))).run_id


def nodectl(tmp_path, *args) -> CLIResult:
    return nodectl_in(tmp_path, "--connect-timeout", "3", *args, timeout=120)


@pytest.mark.parametrize("command", ["stacks", "stop", "collect", "status"])
def test_a_node_that_answers_with_an_error_is_exit_1_not_unreachable(tmp_path, monkeypatch, command):
    monkeypatch.setenv("NODECTL_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("NODECTL_STATE_DIR", str(tmp_path / "state"))   # the user recording it is the one asking
    run_id = recorded_run(tmp_path, f"nodes:\n  - {{host: localhost, name: n0, transport: local, device: cpu, "
                                    f"gpus: 1, workdir: {tmp_path / 'work'}}}\n")
    result = nodectl(tmp_path, command, "--run", run_id)
    assert result.exit_code == EXIT_FAILED, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "n0" in result.stdout + result.stderr
    assert "n0: n0:" not in result.stdout + result.stderr   # the node named once
    if command == "stop":  # the run is not marked stopped: nothing confirmed it
        assert json.loads((tmp_path / "runs" / run_id / "manifest.json").read_text())["state"] == "starting"


@pytest.mark.parametrize("command", ["stacks", "stop", "collect", "status"])
def test_a_node_that_cannot_be_reached_is_exit_3(tmp_path, monkeypatch, command):
    monkeypatch.setenv("NODECTL_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("NODECTL_STATE_DIR", str(tmp_path / "state"))   # the user recording it is the one asking
    run_id = recorded_run(tmp_path, "nodes:\n  - {host: 127.0.0.1, port: 1, name: gone, device: cpu, gpus: 1}\n")
    result = nodectl(tmp_path, command, "--run", run_id)
    assert result.exit_code == EXIT_UNREACHABLE, result.stdout + result.stderr
    assert "gone" in result.stdout + result.stderr and "Traceback" not in result.stderr


def test_tail_of_a_run_whose_node_folder_is_gone_says_so_and_fails(tmp_path, monkeypatch):
    """It printed nothing and exited 0."""
    monkeypatch.setenv("NODECTL_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("NODECTL_STATE_DIR", str(tmp_path / "state"))
    run_id = recorded_run(tmp_path, f"nodes:\n  - {{host: localhost, name: n0, transport: local, device: cpu, "
                                    f"gpus: 1, workdir: {tmp_path / 'work'}}}\n")
    result = nodectl(tmp_path, "tail", "rank0", "--run", run_id)
    assert result.exit_code == EXIT_FAILED, result.stdout + result.stderr
    assert f"n0 has no folder of run {run_id}" in result.stdout, result.stdout


@pytest.mark.parametrize("command", [["status"], ["runs"], ["exec", "--", "true"], ["tail", "rank0"]])
def test_an_inventory_that_is_not_there_is_refused_by_every_command(tmp_path, command):
    """`-i missing.yaml` was refused by exec but silently ignored by status and runs."""
    result = nodectl(tmp_path, "-i", str(tmp_path / "missing.yaml"), *command)
    assert result.exit_code == 2, result.stdout + result.stderr
    assert f"{tmp_path / 'missing.yaml'}: file: not found" in result.stderr and "Traceback" not in result.stderr
