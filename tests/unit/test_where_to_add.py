"""docs/ARCHITECTURE.md's "Where to add", done as a newcomer would: a node verb and a recipe key, each added by
touching the places the doc names and no others (a check and a launch option: test_preflight_registry.py and
test_attending.py)."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.trainer_import import trainer_module

REPO = Path(__file__).resolve().parents[2]


def _runctl(launchers: Path, *argv: str, request: dict | None = None) -> dict:
    done = subprocess.run([sys.executable, "-S", "-m", "runctl", *argv], input=json.dumps(request or {}),
                          cwd=launchers, env={**os.environ, "PYTHONPATH": str(launchers)}, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_new_verb_is_its_function_and_its_line_in_the_table(tmp_path):
    """A verb is a cmd_ function in a runctl module and a line in launchers/verbs.py: runctl answers it, applies
    the trust rule its line names before it runs, and the controller's parser gets its answer type from the same
    line (the answer dataclass and NodeClient's method are held to the table by test_layering.py)."""
    from nodectl.remote import answers

    launchers = tmp_path / "launchers"
    shutil.copytree(REPO / "launchers", launchers, ignore=shutil.ignore_patterns("__pycache__"))
    net = launchers / "runctl" / "net.py"
    net.write_text(net.read_text() + '\n\ndef cmd_echo(args: list, request: dict) -> dict:\n'
                                     '    return {"echoed": request.get("text"), "args": args}\n')
    table = launchers / "verbs.py"
    text = table.read_text()
    assert '    "cleanup": Verb(' in text
    table.write_text(text.replace('    "cleanup": Verb(', '    "echo": Verb("net", "run", "EchoAnswer"),\n'
                                                         '    "cleanup": Verb('))
    run_dir = tmp_path / "work" / "runs" / "20260101-000000-abcd"
    run_dir.mkdir(parents=True)
    (run_dir / "node.json").write_text("{}")
    answer = _runctl(launchers, "echo", str(run_dir), request={"text": "hi"})
    assert answer == {"echoed": "hi", "args": [str(run_dir.resolve())]}   # the guard handed on the real path
    refused = _runctl(launchers, "echo", str(tmp_path / "elsewhere"), request={"text": "hi"})
    assert "not a run folder" in refused["error"] and "echoed" not in refused
    unknown = _runctl(REPO / "launchers", "echo", str(run_dir))   # the shipped table has no such verb
    assert unknown["error"].startswith("echo: no such command (this runctl knows ")

    @dataclasses.dataclass(frozen=True)
    class EchoAnswer:
        echoed: str
        args: tuple[str, ...]

    assert answers.build(EchoAnswer, answer, "runctl echo") == EchoAnswer("hi", (str(run_dir.resolve()),))


def test_a_new_recipe_key_is_a_field_with_its_default(monkeypatch, tmp_path):
    """A recipe key is a field of its section's dataclass: the recipe file and --set reach it, its type is
    checked with the key named, and an unknown key is still refused."""
    config = trainer_module("config")

    @dataclasses.dataclass(frozen=True)
    class Train(config.TrainConfig):
        label_smoothing: float = 0.0

    monkeypatch.setitem(config.SECTIONS, "train", Train)
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text("train:\n  steps: 5\n  label_smoothing: 0.1\n")
    assert config.load_recipe(str(recipe_file), node_files=False).train.label_smoothing == 0.1
    assert config.load_recipe(str(recipe_file), ["train.label_smoothing=0.2"], node_files=False).train.label_smoothing \
        == 0.2
    recipe_file.write_text("train:\n  steps: 5\n")
    assert config.load_recipe(str(recipe_file), node_files=False).train.label_smoothing == 0.0   # absent: its default
    with pytest.raises(config.ConfigError, match="train.label_smoothing: expected float"):
        config.load_recipe(str(recipe_file), ["train.label_smoothing=soon"], node_files=False)
    with pytest.raises(config.ConfigError, match="train.label_smoothing: expected a finite number"):
        config.load_recipe(str(recipe_file), ["train.label_smoothing=nan"], node_files=False)
    with pytest.raises(config.ConfigError, match="train.label_smothing: unknown key"):
        config.load_recipe(str(recipe_file), ["train.label_smothing=0.1"], node_files=False)
