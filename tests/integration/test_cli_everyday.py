"""Everyday command-line behaviour a pdsh/torchrun user expects: global options anywhere, recipes checked before
any node is touched, `--set` passed to the built-in trainer, one message per script mistake, host ranges."""
from __future__ import annotations

import json
import os
import time

import pytest

from support.cli import run_nodectl

UNREACHABLE = "nodes:\n  - host: 192.0.2.1\n    name: far\n    device: cpu\n"  # TEST-NET-1: never answers


@pytest.fixture
def project(project):
    (project / "train.py").write_text("print('hi')\n")
    (project / "hosts.yaml").write_text(UNREACHABLE)
    (project / "local.yaml").write_text("nodes:\n  - host: localhost\n    transport: local\n    device: cpu\n")
    return project


def env_for(tmp_path) -> dict:
    return {**os.environ, "HOME": str(tmp_path), "NODECTL_FORCE_CPU": "1", "NODECTL_STATE_DIR": str(tmp_path / "st")}


def test_global_options_work_after_the_command_but_not_inside_the_users_arguments(project):
    env = env_for(project)
    after = run_nodectl(["launch", "--dry-run", "-i", "local.yaml", "--json", "--", "train.py", "--json", "-v"],
                        env=env, cwd=project)
    assert after.exit_code == 0, after.stderr
    document = after.json()  # --json reached nodectl: stdout is one JSON document
    assert document["plan"]["command"] == ["train.py", "--json", "-v"]  # the script's own --json stayed its own
    listed = run_nodectl(["runs", "--json"], env=env, cwd=project)
    assert listed.exit_code == 0 and listed.json()["runs"] == []


@pytest.mark.parametrize("args,message", [
    (["--set", "train.stepz=3"], "recipe error: train.stepz: unknown key"),
    (["--set", "train.steps=0"], "recipe error: train.steps: expected a positive integer"),
    (["--set", "steps=3"], "expected section.key=value"),
    (["--config", "hosts.yaml"], "recipe error: nodes: unknown section"),
    (["--set", "train.lr=nan"], "recipe error: train.lr: expected a finite number"),
    (["--set", "train.checkpoint_minutes=-1"], "recipe error: train.checkpoint_minutes"),
])
def test_a_bad_recipe_is_refused_before_any_node_is_touched(project, args, message):
    """hosts.yaml names a node that never answers: reaching for it would take the connect timeout and exit 3."""
    started = time.monotonic()
    result = run_nodectl(["launch", *args], env=env_for(project), cwd=project)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.stderr
    assert time.monotonic() - started < 15
    assert not (project / "runs").exists()


def test_set_reaches_the_built_in_trainer_and_is_kept_for_resume(project):
    result = run_nodectl(["-i", "local.yaml", "--json", "launch", "--dry-run", "--set", "train.steps=7",
                          "--set", "lora.r=4"], env=env_for(project), cwd=project)
    assert result.exit_code == 0, result.stderr
    plan = result.json()["plan"]
    assert plan["command"][-4:] == ["--set", "train.steps=7", "--set", "lora.r=4"]
    assert plan["overrides"] == ["train.steps=7", "lora.r=4"]
    mixed = run_nodectl(["-i", "local.yaml", "launch", "--dry-run", "--set", "train.steps=7", "--", "train.py"],
                        env=env_for(project), cwd=project)
    assert mixed.exit_code == 2 and "your script takes its own options" in mixed.stderr


def test_each_script_mistake_gets_its_own_message(project, tmp_path_factory):
    (project / "ignored").mkdir()
    (project / "ignored" / "run.py").write_text("print(1)\n")
    (project / ".gitignore").write_text("ignored/\n")
    outside = tmp_path_factory.mktemp("elsewhere") / "run.py"
    outside.write_text("print(1)\n")
    cases = {"nope.py": "does not exist", "ignored": "is a folder", "ignored/run.py": "excluded from the sync by "
             ".gitignore", str(outside): "is outside the synced folder"}
    for script, message in cases.items():
        result = run_nodectl(["-i", "local.yaml", "launch", "--dry-run", "--", script], env=env_for(project),
                             cwd=project)
        assert result.exit_code == 2 and message in result.stderr, (script, result.stderr)


def test_nodes_and_exclude_take_names_and_ranges(project):
    (project / "many.yaml").write_text("defaults: {device: cpu, gpus: 1}\nnodes:\n  - host: 10.9.0.[1-4]\n"
                                       "    name: gpu[01-04]\n")
    env = env_for(project)

    def nodes_of(*args):
        result = run_nodectl(["-i", "many.yaml", "--json", "launch", "--dry-run", *args, "--", "train.py"], env=env,
                             cwd=project)
        assert result.exit_code == 0, result.stderr
        return [entry["node"]["name"] for entry in result.json()["plan"]["nodes"]]

    assert nodes_of("--nodes", "gpu[02-03]") == ["gpu02", "gpu03"]
    assert nodes_of("--nodes", "2", "--exclude", "gpu[01,03]") == ["gpu02", "gpu04"]
    assert nodes_of("--nodes", "10.9.0.4,gpu01") == ["gpu01", "gpu04"]  # node-rank order, hosts work too
    wrong = run_nodectl(["-i", "many.yaml", "launch", "--dry-run", "--nodes", "gpu[04-06]", "--", "train.py"],
                        env=env, cwd=project)
    assert wrong.exit_code == 2 and "--nodes names no node of many.yaml: gpu[05-06]" in wrong.stderr
    assert json.loads(run_nodectl(["-i", "many.yaml", "--json", "launch", "--dry-run", "--", "train.py"], env=env,
                                  cwd=project).stdout)["plan"]["nodes"][3]["node"]["host"] == "10.9.0.4"


def test_waits_past_the_node_count_show_what_is_running(tmp_path):
    """preflight's bar sat on a finished "2/2" for the whole collective test; a phase now names the wait."""
    import io

    from rich.console import Console

    from nodectl.cli.context import AppContext

    screen = io.StringIO()
    app = AppContext(err=Console(file=screen, force_terminal=True, width=120))
    with app.node_progress("probing nodes", 2) as advance:
        advance(None)
        advance(None)
        advance.phase("all-reduce test on 2 node(s)")
        time.sleep(0.3)
    assert "all-reduce test on 2 node(s)" in screen.getvalue()


def test_tables_do_not_wrap_when_piped(project):
    long_name = "n" * 60
    (project / "wide.yaml").write_text(f"nodes:\n  - host: localhost\n    name: {long_name}\n    transport: local\n"
                                       f"    device: cpu\n")
    env = {k: v for k, v in env_for(project).items() if k != "COLUMNS"}
    result = run_nodectl(["-i", "wide.yaml", "launch", "--dry-run", "--", "train.py"], env=env, cwd=project)
    assert result.exit_code == 0
    assert f"---- {long_name}: launch.sh ----" in result.stdout.splitlines()
    dump = run_nodectl(["-i", "wide.yaml", "env-dump", "-o", str(project / "dump")], env=env, cwd=project)
    assert dump.exit_code == 0, dump.stderr
    row = next(line for line in dump.stdout.splitlines() if long_name in line)  # 80 columns cut it in 4-letter bits
    import torch

    assert torch.__version__ in row  # the whole row, the node's torch version included, on one line


def test_a_second_launch_on_a_fixed_port_names_the_live_run_holding_it(project):
    """The README's fixed master_port and a run still alive there: the second launch says which run holds the
    port and how to end it, before anything starts (the cached preflight does not hide it)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (project / "fixed.yaml").write_text(f"master_port: {port}\nnodes:\n  - {{host: localhost, transport: local, "
                                        f"device: cpu, workdir: {project / 'work'}}}\n")
    (project / "train.py").write_text("import torch.distributed as dist, time\ndist.init_process_group('gloo')\n"
                                      "print('up', flush=True)\ntime.sleep(300)\n")
    env = env_for(project)
    first = run_nodectl(["launch", "-i", "fixed.yaml", "--detach", "--", "train.py"], env=env, cwd=project)
    assert first.exit_code == 0, first.stderr
    run_id = run_nodectl(["runs", "--json"], env=env, cwd=project).json()["runs"][-1]["run_id"]
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            tail = run_nodectl(["tail", "rank0", "--run", run_id], env=env, cwd=project)
            if "up" in tail.stdout:
                break
            time.sleep(0.5)
        second = run_nodectl(["launch", "-i", "fixed.yaml", "--", "train.py"], env=env, cwd=project)
        assert second.exit_code == 1, second.stdout + second.stderr
        assert f"master_port {port} is in use" in second.stderr and f"nodectl stop --run {run_id}" in second.stderr
        assert "launch --force" in second.stderr and "Traceback" not in second.stderr
        # --force: this run takes a free port and starts beside the live one
        forced = run_nodectl(["--json", "launch", "-i", "fixed.yaml", "--force", "--detach", "--", "train.py"],
                             env=env, cwd=project)
        assert forced.exit_code == 0, forced.stdout + forced.stderr
        forced_id = forced.json()["run_id"]
        manifest = json.loads((project / "runs" / forced_id / "manifest.json").read_text())
        assert manifest["plan"]["master_port"] != port
        run_nodectl(["stop", "--run", forced_id], env=env, cwd=project)
    finally:
        run_nodectl(["stop", "--run", run_id], env=env, cwd=project)


def test_when_torchrun_fails_before_any_rank_its_own_last_lines_are_shown(project, tmp_path_factory):
    """A node whose python lacks torch (preflight skipped): torchrun itself fails. The failure says so with
    torchrun's last lines, not only "see logs/launcher.log on the node"."""
    import subprocess
    import sys

    bare = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    (project / "bare.yaml").write_text(f"nodes:\n  - {{host: localhost, transport: local, device: cpu, "
                                       f"python: {bare / 'bin' / 'python'}, workdir: {project / 'work'}}}\n")
    result = run_nodectl(["launch", "-i", "bare.yaml", "--skip-preflight", "--", "train.py"], env=env_for(project),
                         cwd=project)
    assert result.exit_code == 1, result.stdout + result.stderr
    assert "last lines of torchrun on" in result.stderr and "No module named 'torch'" in result.stderr
    assert "nodectl tail launcher" in result.stderr
    shown = run_nodectl(["tail", "launcher", "-i", "bare.yaml"], env=env_for(project), cwd=project)
    assert shown.exit_code == 0 and "No module named 'torch'" in shown.stdout, shown.stdout + shown.stderr


def test_everyday_honesty_a_users_script_its_outputs_stop_and_status(project):
    """A user's script does not get the built-in trainer's HF_HUB_OFFLINE; the banner says where outputs go;
    `stop` names the run it stops; a stopped run reads "stopped by the user", not as a rank failure; `-i ""` is an
    error, not this machine; no inventory at all is said aloud."""
    (project / "train.py").write_text("import os, time\nprint('offline=' + str(os.environ.get('HF_HUB_OFFLINE')), "
                                      "flush=True)\ntime.sleep(300)\n")
    env = env_for(project)
    first = run_nodectl(["launch", "-i", "local.yaml", "--skip-preflight", "--detach", "--", "train.py"], env=env,
                        cwd=project)
    assert first.exit_code == 0, first.stderr
    assert "$NODECTL_OUTPUT_DIR" in first.stderr
    run_id = run_nodectl(["runs", "--json"], env=env, cwd=project).json()["runs"][-1]["run_id"]
    deadline = time.time() + 60
    while "offline=" not in (tail := run_nodectl(["tail", "rank0"], env=env, cwd=project)).stdout:
        assert time.time() < deadline, tail.stdout + tail.stderr
        time.sleep(0.5)
    assert "offline=None" in tail.stdout
    stopped = run_nodectl(["stop"], env=env, cwd=project)
    assert stopped.exit_code == 0 and f"stopping run {run_id}" in stopped.stderr, stopped.stderr
    status = run_nodectl(["status"], env=env, cwd=project)
    assert "stopped by the user" in status.stdout and "cause" not in status.stdout, status.stdout
    empty = run_nodectl(["launch", "--dry-run", "-i", ""], env=env, cwd=project)
    assert empty.exit_code == 2 and "empty path" in empty.stderr
    (project / "hosts.yaml").unlink()
    nothing = run_nodectl(["launch", "--dry-run", "--", "train.py"], env=env, cwd=project)
    assert nothing.exit_code == 0 and "using this machine" in nothing.stderr


@pytest.mark.parametrize("args, words", [
    (["--connect-timeout", "nan", "status"], "not a finite number of seconds"),
    (["--connect-timeout", "inf", "status"], "not a finite number of seconds"),
    (["stop", "--grace", "nan"], "not a finite number of seconds"),
    (["preflight", "--quick", "--full"], "--quick and --full"),
    (["launch", "--resume", "", "--dry-run"], "--resume: an empty run id"),
])
def test_options_that_cannot_mean_anything_are_usage_errors(project, args, words):
    result = run_nodectl(args, env=env_for(project), cwd=project)
    assert result.exit_code == 2 and words in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_chat_records_for_a_model_without_a_template_are_refused_on_the_controller(project):
    """Seen before any node is touched (the project has both files), not on every rank after the start."""
    model = project / "plain-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    (project / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                                 {"role": "assistant", "content": "yo"}]}) + "\n")
    result = run_nodectl(["launch", "--dry-run", "--set", f"model.path={model}", "--set", "data.path=chat.jsonl"],
                         env=env_for(project), cwd=project)
    assert result.exit_code == 2 and "has no chat template" in result.stderr, result.stderr
    with_demo = run_nodectl(["launch", "--dry-run", "-i", "local.yaml", "--set", "data.path=chat.jsonl"],
                            env=env_for(project), cwd=project)
    assert with_demo.exit_code == 0, with_demo.stderr


def test_a_scripts_relative_output_dir_comes_home_with_collect(project):
    """A third-party script's `--output_dir out` lands in <run>/code/out on the node: plain `collect` brings it
    back and says so (the synced project stays on the node); `--path` adds a synced file, a path outside the run is
    refused. On the ended run, `diagnose` keeps no folder, and `report` without metrics is a failed run's 1.
    The launch runs as `nodectl launch ... > launch.log` (or nohup, or `| tee`) inside the project: the growing log
    is nodectl's own output, not sent; a log another process writes meanwhile travels as a snapshot."""
    import subprocess
    import sys

    (project / "train.py").write_text("import os, sys\nos.makedirs(sys.argv[2], exist_ok=True)\n"
                                      "open(os.path.join(sys.argv[2], 'result.txt'), 'w').write('42')\n"
                                      "print('trained', flush=True)\n")
    (project / "other.log").write_text("start\n")
    env = env_for(project)
    writer = subprocess.Popen([sys.executable, "-c", "import time\nwhile True:\n  open('other.log','a').write('x'*4096)"
                               "\n  time.sleep(0.001)"], cwd=project)
    try:
        with open(project / "launch.log", "w") as log:
            ran = subprocess.run([sys.executable, "-m", "nodectl", "launch", "-i", "local.yaml", "--skip-preflight",
                                  "--", "train.py", "--output_dir", "out"], cwd=project, env=env, stdout=log,
                                 stderr=subprocess.STDOUT, timeout=180)
    finally:
        writer.kill()
    text = (project / "launch.log").read_text()
    assert ran.returncode == 0, text
    assert "trained" in text and "changed while it was being sent" not in text
    assert "$NODECTL_OUTPUT_DIR" in text
    run_id = run_nodectl(["runs", "--json"], env=env, cwd=project).json()["runs"][-1]["run_id"]
    nodes = project / "runs" / run_id / "nodes"
    collected = run_nodectl(["collect"], env=env, cwd=project)
    assert collected.exit_code == 0, collected.stderr
    assert "code/: 1 file(s) the program wrote there, brought back (out/result.txt)" in collected.stderr
    [result] = nodes.glob("*/code/out/result.txt")
    assert result.read_text() == "42" and not list(nodes.glob("*/code/train.py"))
    brought = run_nodectl(["collect", "--path", "code/train.py", "--path", "code/nothing"], env=env, cwd=project)
    assert brought.exit_code == 0, brought.stderr
    assert len(list(nodes.glob("*/code/train.py"))) == 1
    assert "asked for with --path and not found: code/nothing" in brought.stderr
    diagnosed = run_nodectl(["diagnose"], env=env, cwd=project)
    assert diagnosed.exit_code == 1 and "it is not hung, it ended" in diagnosed.stdout, diagnosed.output
    assert not (project / "runs" / run_id / "diagnosis").exists()
    report = run_nodectl(["report"], env=env, cwd=project)
    assert report.exit_code == 1 and "no metrics were collected" in report.stderr and "Traceback" not in report.stderr
    for bad in ("../../etc", "/etc", "code/../../x"):
        refused = run_nodectl(["collect", "--path", bad], env=env, cwd=project)
        assert refused.exit_code == 2 and "inside the run folder" in refused.stderr, refused.stderr


def test_stop_lets_the_trainer_checkpoint_and_resume_continues_from_there(project, demo_cache):
    """`nodectl stop` sends SIGTERM: the built-in trainer checkpoints at its next logging step (every rank agrees
    there) and exits; `launch --resume` then continues from that step, with no checkpoint setting in the recipe.
    The checkpoint is written in the background (train.async_checkpoint), each write slowed to 2 s: the ranks exit
    only once it is complete."""
    import re

    (project / "demo.yaml").write_text(f"nodes:\n  - {{host: localhost, transport: local, device: cpu, gpus: 2, "
                                       f"env: {{NODECTL_DEMO_CACHE: '{demo_cache}', "
                                       f"NODECTL_TEST_SLOW_CHECKPOINT_WRITE: '2'}}}}\n")
    env = env_for(project)
    started = run_nodectl(["launch", "-i", "demo.yaml", "--skip-preflight", "--detach", "--set", "train.steps=100000",
                           "--set", "train.log_every=2", "--set", "train.async_checkpoint=true"], env=env, cwd=project)
    assert started.exit_code == 0, started.stderr
    run_id = run_nodectl(["runs", "--json"], env=env, cwd=project).json()["runs"][-1]["run_id"]

    def step() -> int:
        ranks = run_nodectl(["--json", "status"], env=env, cwd=project).json()["ranks"]
        return min((r.get("step") or 0) for r in ranks)

    deadline = time.time() + 180
    while step() < 4:
        assert time.time() < deadline, run_nodectl(["tail", "all"], env=env, cwd=project).stdout
        time.sleep(1)
    stopped = run_nodectl(["stop", "--grace", "60"], env=env, cwd=project)
    assert stopped.exit_code == 0, stopped.stdout + stopped.stderr
    said = run_nodectl(["tail", "rank0", "-n", "30"], env=env, cwd=project).stdout
    found = re.search(r"stopped by SIGTERM at step (\d+); checkpoint written", said)
    assert found, said
    at = int(found[1])
    assert at % 2 == 0 and at >= 4
    resumed = run_nodectl(["launch", "-i", "demo.yaml", "--resume", run_id, "--set", f"train.steps={at + 2}"], env=env,
                          cwd=project,
                          timeout=300)
    assert resumed.exit_code == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"resuming at step {at}" in resumed.stdout
    # a new train.steps recomputes the learning-rate schedule: said, with the rate it gives now
    assert f"train.steps is {at + 2} (was 100000): the learning rate follows the schedule of {at + 2} steps" \
        in resumed.stdout, resumed.stdout[-2000:]


@pytest.mark.parametrize("node, message", [
    ("{host: ':', transport: local}", "':' is neither (an IPv6 address"),
    ("{host: '[::1]', transport: local}", "its host ::1 is an IPv6 address, which cannot name"),
    ("{host: localhost, transport: local, workdir: rel/dir}", "an absolute path or one in the login user's home"),
    ("{host: localhost, transport: local, workdir: '~bob/x'}", "~user is not supported"),
    ("{host: localhost, transport: local, env: {BIG: " + "x" * 140_000 + "}}", "a value under 128 KiB: Linux refuses"),
])
def test_odd_hosts_workdirs_and_env_are_refused_with_the_reason(project, node, message):
    (project / "odd.yaml").write_text(f"nodes:\n  - {node}\n")
    result = run_nodectl(["launch", "-i", "odd.yaml", "--dry-run", "--", "train.py"], env=env_for(project),
                         cwd=project)
    assert result.exit_code == 2 and message in result.stderr, result.stderr[-500:]


def test_a_bracketed_ipv6_host_with_a_name_is_the_address(project):
    (project / "v6.yaml").write_text("nodes:\n  - {host: '[::1]', name: v6, transport: local}\n")
    result = run_nodectl(["--json", "launch", "-i", "v6.yaml", "--dry-run", "--", "train.py"], env=env_for(project),
                         cwd=project)
    assert result.exit_code == 0, result.stderr
    assert result.json()["plan"]["nodes"][0]["node"]["host"] == "::1"


def test_a_non_utf8_argument_and_an_output_that_is_not_a_folder_are_usage_errors(project):
    env = env_for(project)
    result = run_nodectl(["launch", "-i", "local.yaml", "--dry-run", "--", "train.py", os.fsdecode(b"\xff")], env=env,
                         cwd=project)
    assert result.exit_code == 2 and "argument 2 after `--` is not UTF-8 text (b'\\xff')" in result.stderr
    dumped = run_nodectl(["env-dump", "-i", "local.yaml", "-o", "/dev/full"], env=env, cwd=project)
    assert dumped.exit_code == 2 and "-o /dev/full: not a folder" in dumped.stderr, dumped.stderr
