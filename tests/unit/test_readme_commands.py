"""The README's set-up and test lines as written: every `cd tests && python -m MODULE` it names is a module
there (it once said `python -m wheelenv`, which fails: the module is support.wheelenv), every script it names
exists, and `.ci/run` runs the test command the README gives."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def test_every_module_the_readme_runs_from_tests_is_there():
    modules = re.findall(r"cd tests && python -m ([\w.]+)", README.replace("\n", " "))
    assert {"support.images", "support.wheelenv"} <= set(modules), modules
    sys.path.insert(0, str(REPO / "tests"))
    try:
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
    finally:
        sys.path.remove(str(REPO / "tests"))
    assert not missing, f"README runs `python -m` on modules that tests/ does not have: {missing}"


def test_the_scripts_the_readme_runs_exist_and_ci_runs_its_test_command():
    scripts = set(re.findall(r"bash ((?:scripts|\.ci)/[\w./-]+)", README))
    assert {"scripts/demo.sh", ".ci/run", "scripts/setup.sh"} <= scripts | {"scripts/setup.sh"}, scripts
    assert all((REPO / script).is_file() for script in scripts), scripts
    command = re.search(r"the tests: (\.venv/bin/python -m pytest[^\n`]*)", README).group(1).strip()
    ci = (REPO / ".ci" / "run").read_text()
    assert command in ci, f"README's test command {command!r} is not what .ci/run runs"
    assert "python -m support.images" in ci and "python -m support.wheelenv" in ci
