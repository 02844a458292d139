"""The tool as users install it: the wheel holds the tree, and the `nodectl` of a non-editable install (a venv of
its own, tests/support/wheelenv.py) starts, runs the local demo and launches on two isolated SSH nodes that have no
nodectl at all."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest

from support import REPO

from support.sshcluster import running_cluster
from support import wheelenv

pytestmark = pytest.mark.slow

# Where each folder of the tree lands in the wheel, and which of its files are shipped (Python, plus the data
# files the tool reads at run time).
SHIPPED = {"nodectl": ("nodectl", {".py"}), "launchers": ("nodectl/resources/launchers", {".py"}),
           "templates": ("nodectl/resources/templates", {".py", ".j2"}),
           "trainer": ("nodectl/resources/trainer", {".py", ".yaml", ".jsonl", ".txt"})}


BUILD_LOG: list[str] = []


@pytest.fixture(scope="module")
def wheel():
    with tempfile.TemporaryDirectory(prefix="nodectl-wheel-test-") as dest:
        yield wheelenv.build_wheel(Path(dest), BUILD_LOG)


@pytest.fixture(scope="module")
def installed() -> Path:
    """bin/ of the venv holding this tree's wheel (not editable)."""
    return wheelenv.ensure()


def expected_files() -> set[str]:
    expected = set()
    for name in wheelenv.tracked_files():
        top, _, rest = name.partition("/")
        if top in SHIPPED and rest and Path(name).suffix in SHIPPED[top][1]:
            expected.add(f"{SHIPPED[top][0]}/{rest}")
    return expected


def test_wheel_holds_every_module_and_resource_of_the_tree(wheel):
    names = wheelenv.wheel_names(wheel)
    files = {n for n in names if ".dist-info/" not in n}
    expected = expected_files()
    assert "nodectl/diagnose/verdicts.py" in expected and "nodectl/resources/trainer/requirements.txt" in expected
    assert sorted(expected - files) == [], "the wheel lacks these files of the tree"
    assert sorted(files - expected) == [], "the wheel holds files the tree does not (a stale build?)"
    assert {n.split("/")[0] for n in files} == {"nodectl"}, "a wheel must claim no top-level name but nodectl"
    # setuptools' deprecations (a license table, a listed package) become errors in later versions
    assert "Warning" not in BUILD_LOG[0] and "deprecat" not in BUILD_LOG[0].lower(), BUILD_LOG[0][-3000:]


def test_train_extra_is_torch_plus_the_nodes_requirements_file():
    """What `pip install nodectl[train]` gives the controller is what a node installs from the shipped file."""
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]
    lines = [line.split("#")[0].strip() for line in (REPO / "trainer" / "requirements.txt").read_text().splitlines()]
    requirements = [line for line in lines if line]
    assert not any(re.match(r"torch\b", line) for line in requirements), "torch is left to the node's CUDA"
    assert sorted(extra) == sorted(["torch>=2.6", *requirements])


def _user_env(home: Path, **extra) -> dict:
    """A user's shell: the wheel's venv on PATH, no checkout on PYTHONPATH, no nodectl variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NODECTL_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(HOME=str(home), PATH=f"{wheelenv.VENV / 'bin'}:/usr/bin:/bin", COLUMNS="120", **extra)
    return env


def _nodectl(installed: Path, args: list[str], cwd: Path, env: dict, timeout: float = 300):
    return subprocess.run([str(installed / "nodectl"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_installed_cli_starts_and_every_command_has_help(installed, tmp_path):
    env = _user_env(tmp_path)
    where = subprocess.run([str(installed / "python"), "-c", "import nodectl, sys; print(nodectl.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True)
    assert where.stdout.startswith(str(wheelenv.VENV)), "the venv must run the installed copy, not the checkout"
    version = _nodectl(installed, ["--version"], tmp_path, env)
    assert version.returncode == 0 and "nodectl, version" in version.stdout, version.stderr
    top = _nodectl(installed, ["--help"], tmp_path, env)
    assert top.returncode == 0, top.stderr
    commands = re.findall(r"^  ([a-z][a-z-]+)\s", top.stdout.split("Commands:")[1], re.M)
    assert {"preflight", "launch", "diagnose", "collect", "report", "top"} <= set(commands)
    for name in commands:
        shown = _nodectl(installed, [name, "--help"], tmp_path, env)
        assert shown.returncode == 0 and "Usage:" in shown.stdout, f"{name}: {shown.stderr[-1000:]}"


@pytest.mark.timeout(600)   # launch and collect: about 60 s on CI's machine, 300 s on a slow day of this one
def test_installed_local_demo_launch(installed, tmp_path, demo_cache):
    """The README's main job, from the wheel: the built-in trainer's demo on two local "nodes" learns its task,
    writes its adapter, and comes home with collect; status's heartbeat holds the last record's own loss."""
    env = _user_env(tmp_path / "home", NODECTL_DEMO_CACHE=str(demo_cache), NODECTL_FORCE_CPU="1")
    project = tmp_path / "project"
    project.mkdir()
    done = _nodectl(installed, ["launch", "--nodes", "2", "--gpus", "1", "--skip-preflight"], project, env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"run \S+ succeeded", done.stdout + done.stderr) and "adapter saved to" in done.stdout
    assert "Warning" not in done.stdout + done.stderr, "the demo prints no library's warning"
    assert "tok/s/rank" in done.stdout and "tok/s/gpu" not in done.stdout and "every GPU" not in done.stdout, \
        "a CPU run is not labelled as GPUs"
    run_id = json.loads(_nodectl(installed, ["--json", "runs"], project, env).stdout)["runs"][-1]["run_id"]
    assert _nodectl(installed, ["collect"], project, env).returncode == 0
    collected = project / "runs" / run_id / "nodes" / "local0" / "output"
    records = [json.loads(line) for line in (collected / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] <= 0.7 * losses[0], losses
    assert (collected / "adapter" / "adapter_model.safetensors").is_file()
    heartbeat = json.loads((project / "runs" / run_id / "nodes" / "local0" / "heartbeat" / "rank0.json").read_text())
    last = [r for r in records if "loss" in r][-1]
    # status and top show the heartbeat: its loss is the last logged step's own, not the window before it
    assert heartbeat["step"] == last["step"] == 80 and heartbeat["loss"] == last["loss"]
    # the seconds this rank spent making its batches, from which the pace watch takes its data-wait share
    assert 0 < heartbeat["data_s"] < 60, heartbeat


def test_outputs_without_boto3_are_named_by_the_launch_status_and_collect(installed, tmp_path):
    """A plain `pip install nodectl` has no boto3: a run given a bucket says so while it runs (its uploader on the
    node cannot send) and in status, and `collect --from-store` says what to install, never a raw answer."""
    env = _user_env(tmp_path / "home")
    project = tmp_path / "project"
    project.mkdir()
    (project / "job.py").write_text("import time\ntime.sleep(4)\nprint('done')\n")
    assert subprocess.run([str(installed / "python"), "-c", "import boto3"], env=env).returncode == 1
    done = _nodectl(installed, ["launch", "--nodes", "1", "--gpus", "1", "--skip-preflight", "--outputs",
                                "s3://team-ckpts/run", "job.py"], project, env)
    said = done.stdout + done.stderr
    assert done.returncode == 0 and "done" in done.stdout, said[-3000:]
    assert f"could not upload: boto3 is not installed for {installed / 'python'}" in said, said[-3000:]
    status = _nodectl(installed, ["status"], project, env)
    assert "upload error" in status.stdout and "boto3 is not installed" in status.stdout, status.stdout
    collect = _nodectl(installed, ["collect", "--from-store"], project, env)
    assert collect.returncode == 1 and "Traceback" not in collect.stderr, collect.stderr
    assert collect.stderr.strip().splitlines()[-1] == (
        f"Error: collect --from-store reads the bucket from this machine, which has no boto3 for "
        f"{installed / 'python'}: pip install 'nodectl[s3]' (or boto3)")


def test_installed_ssh_launch_on_nodes_without_nodectl(installed, tmp_path_factory, tmp_path, demo_cache):
    """Two isolated SSH nodes whose Python has torch but no nodectl: the built-in trainer travels with the run,
    under a name that the project's own `trainer/` folder does not shadow."""
    with running_cluster(tmp_path_factory, 2, first_octet=60) as cluster:
        inventory = cluster.inventory(env={"NODECTL_DEMO_CACHE": "/tmp/demo-cache"})
        env = {**_user_env(cluster.home), "NODECTL_INVENTORY": str(inventory)}
        project = tmp_path / "project"
        (project / "trainer").mkdir(parents=True)
        (project / "trainer" / "__init__.py").write_text("raise SystemExit('the project trainer/ shadowed it')\n")
        probe = _nodectl(installed, ["exec", "--", "/opt/venv/bin/python", "-c", "import nodectl"], project, env)
        assert probe.returncode == 1 and "No module named 'nodectl'" in probe.stdout + probe.stderr, probe.stdout
        done = _nodectl(installed, ["launch", "--set", "train.steps=10"], project, env)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "completed 10 steps" in done.stdout
        for node in cluster.nodes:
            assert list(node.workdir.rglob("lib/nodectl_trainer/__main__.py")), f"{node.name} got no trainer"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
