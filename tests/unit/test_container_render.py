"""`container:` rendered into launch.sh for every runtime: what only a GPU host can run (docker --gpus, podman's
CDI devices, apptainer --nv, enroot) is checked here on the command itself; podman runs for real in
tests/integration/test_containers.py."""
from __future__ import annotations

import json
import shlex
import subprocess
from dataclasses import replace

import pytest

from nodectl.errors import InventoryError
from nodectl.inventory import parse_inventory
from nodectl.plan import build_plan
from nodectl.render import render_plan

INVENTORY = """\
master_port: 29500
defaults:
  gpus: 8
  device: {device}
  env: {{HF_TOKEN: hf_secret_value, NCCL_SOCKET_IFNAME: ens1}}
  container: {{image: "nvcr.io/nvidia/pytorch:25.01-py3", runtime: {runtime}, mounts: ["/data:/data:ro"],
              options: ["--shm-size", "1g"]}}
nodes:
  - {{host: 10.0.0.11, name: node0}}
  - {{host: 10.0.0.12, name: node1}}
"""


def rendered(runtime: str, device: str = "cuda", node: int = 1) -> str:
    inventory = parse_inventory(INVENTORY.format(runtime=runtime, device=device))
    plan = build_plan(inventory, gpus=None, command=("train.py", "--lr", "3e-4"), sync_dir="/src/project",
                      run_id="20260101-000000-abcd")
    return render_plan(replace(plan, created=0.0))[node].launch


def command_words(script: str, first: str) -> list[str]:
    """The words of the command that starts with `first`, as bash would split them (variables left as they are)."""
    start = script.index("\n" + first + " ") + 1
    text = script[start:script.index('rankexec.py"', start) + len('rankexec.py"')]
    return shlex.split(text.replace("\\\n", " "))


@pytest.mark.parametrize("runtime", ["docker", "podman", "apptainer", "enroot"])
def test_every_runtime_renders_a_script_bash_accepts(runtime, tmp_path):
    script = tmp_path / "launch.sh"
    script.write_text(rendered(runtime))
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True).returncode == 0
    assert "hf_secret_value" not in script.read_text()


@pytest.mark.parametrize("runtime,gpu", [("docker", ["--gpus", "all"]),
                                         ("podman", ["--device", "nvidia.com/gpu=all", "--security-opt",
                                                     "label=disable"])])
def test_docker_and_podman_get_what_distributed_training_needs(runtime, gpu):
    words = command_words(rendered(runtime), runtime)
    joined = " ".join(words)
    assert words[:2] == [runtime, "run"] and "--rm" in words
    assert words[words.index("--name") + 1] == "$CONTAINER"
    for flag, value in (("--network", "host"), ("--ipc", "host"), ("--pid", "host"), ("--workdir", "$RUN_DIR/code"),
                        ("--volume", "$RUN_DIR:$RUN_DIR:ro")):
        assert value in [words[i + 1] for i, w in enumerate(words) if w == flag], flag
    # the run folder read-only; the ranks' own folders bound writable over it; state/ hidden
    script = rendered(runtime)
    assert "for part in code logs ranks heartbeat stacks output flight timing metrics torchelastic; do" in script
    assert 'run_mounts+=(--volume "$RUN_DIR/$part:$RUN_DIR/$part:rw")' in script
    assert "for part in state; do" in script and '"$RUN_DIR/lib/hidden:$RUN_DIR/$part:ro"' in script
    assert joined.count(" ".join(gpu)) == 1
    assert "memlock=$(hard_limit -l 1024)" in joined and "nofile=$(hard_limit -n 1)" in joined
    assert "--volume /data:/data:ro" in joined and "--shm-size 1g" in joined
    # every variable of env.sh goes in by name, so no value is ever on a command line
    assert "--env HF_TOKEN" in joined and "--env NODECTL_RUN_ID" in joined and "--env NCCL_SOCKET_IFNAME" in joined
    image = words.index("nvcr.io/nvidia/pytorch:25.01-py3")
    # torchrun's agent, through lib/elastic_agent.py (its imports with the collector off), inside the image
    assert words[image + 1:image + 3] == ["python3", "$RUN_DIR/lib/elastic_agent.py"]
    assert words.index("--shm-size") < image   # the user's options are the runtime's, before the image
    assert ("--user" in words) == (runtime == "docker")   # a root daemon's files in the run folder would be root's


def test_cpu_nodes_get_no_gpu_flags():
    script = rendered("docker", device="cpu", node=1)
    assert "--gpus" not in script and "--pid host" in script


def test_apptainer_and_enroot():
    apptainer = command_words(rendered("apptainer"), "apptainer")
    assert apptainer[:3] == ["apptainer", "exec", "--nv"]
    assert "$RUN_DIR:$RUN_DIR:ro" in apptainer and "--pwd" in apptainer and "/data:/data:ro" in apptainer
    enroot = rendered("enroot")
    assert 'enroot create --force --name "$CONTAINER"' in enroot and 'enroot remove -f "$CONTAINER"' in enroot
    words = command_words(enroot, "enroot start")
    assert "--env" in words and "HF_TOKEN" in words and '"$CONTAINER"' not in words and "$CONTAINER" in words


def test_the_trap_removes_the_container_and_names_are_per_node():
    scripts = [rendered("podman", node=i) for i in (0, 1)]
    names = [s.split("CONTAINER=", 1)[1].split("\n", 1)[0] for s in scripts]
    assert names == ["nodectl-20260101-000000-abcd-node0", "nodectl-20260101-000000-abcd-node1"]
    trap = scripts[0].split("record_exit() {", 1)[1].split("\n}", 1)[0]
    assert 'podman rm -f "$CONTAINER"' in trap


@pytest.mark.parametrize("document,expected", [
    ("defaults: {container: {image: i, runtime: lxc}}\nnodes: [{host: a}]", "one of docker, podman"),
    ("nodes: [{host: a, container: {runtime: podman}}]", "container.image"),
    ("nodes: [{host: a, container: {image: i, mounts: [data:/data]}}]", "absolute SOURCE"),
    ("nodes: [{host: a, container: {image: i, gpus: all}}]", "unknown key"),
    ("nodes: [{host: a, container: {image: i, options: [1]}}]", "a list of strings"),
])
def test_bad_container_settings_name_the_key(document, expected):
    with pytest.raises(InventoryError) as caught:
        parse_inventory(document)
    assert expected in str(caught.value)


def test_a_node_overrides_or_turns_off_the_default_container():
    inventory = parse_inventory("defaults: {container: {image: a:1, runtime: podman}}\n"
                                "nodes: [{host: x}, {host: y, container: {image: b:2}}, {host: z, container: null}]")
    x, y, z = inventory.nodes
    assert (x.container.image, y.container.image, y.container.runtime, z.container) == ("a:1", "b:2", "podman", None)


def test_a_secret_in_container_options_or_mounts_is_shown_and_stored_as_stars():
    """`-e WANDB_API_KEY=...` among a container's options (issue 40): the value reaches the node in env.sh only
    (see the next tests); what a dry run prints, scripts/<node>.sh keeps and the manifest records never hold it."""
    inventory = parse_inventory(
        "defaults:\n  device: cpu\n  container:\n    image: img:1\n    runtime: podman\n"
        "    options: ['-e', 'WANDB_API_KEY=wandb-5e3c7f9a2b', '--ulimit', 'nofile=1024:1024']\n"
        "    mounts: ['/data:/data:ro']\n"
        "nodes:\n  - host: a\n  - host: b\n")
    plan = build_plan(inventory, gpus=1, command=("train.py",), sync_dir=".")
    node = render_plan(plan)[0]
    assert "WANDB_API_KEY=wandb-5e3c7f9a2b" in node.env and "wandb-5e3c7f9a2b" not in node.launch
    for shown in (node.launch_redacted, str(plan.to_json()), node.env_redacted):
        assert "wandb-5e3c7f9a2b" not in shown, shown
    assert "WANDB_API_KEY=***" in str(plan.to_json()) and "--env WANDB_API_KEY" in node.launch_redacted
    assert "nofile=1024:1024" in node.launch_redacted and "/data:/data:ro" in node.launch_redacted


@pytest.mark.parametrize("form", [["--env=HF_TOKEN=hf-plain-9f3a1c"], ["-eHF_TOKEN=hf-plain-9f3a1c"],
                                  ["--env", "HF_TOKEN=hf-plain-9f3a1c"], ["-e", "HF_TOKEN=hf-plain-9f3a1c"]])
def test_every_form_of_an_env_option_is_redacted_in_every_record(form):
    """`--env=HF_TOKEN=...` was stored verbatim, four times, in manifest.json (only `-e NAME=value` was masked):
    each form reaches the node in env.sh alone, and the plan's record, the dry run's script and env.sh's shown
    copy hold ***."""
    inventory = parse_inventory(json.dumps({"defaults": {"device": "cpu", "container": {
        "image": "img:1", "runtime": "podman", "options": form}}, "nodes": [{"host": "a"}]}))
    plan = build_plan(inventory, gpus=1, command=("train.py",), sync_dir=".")
    node = render_plan(plan)[0]
    assert "HF_TOKEN=hf-plain-9f3a1c" in node.env and "hf-plain-9f3a1c" not in node.launch
    for shown in (node.launch_redacted, json.dumps(plan.to_json()), node.env_redacted):
        assert "hf-plain-9f3a1c" not in shown, shown


@pytest.mark.parametrize("setting, key", [
    ("options: ['--privileged']", "options"),
    ("options: ['--cap-add=SYS_ADMIN']", "options"),
    ("options: ['--security-opt', 'seccomp=unconfined']", "options"),
    ("options: ['--device', '/dev/sda']", "options"),
    ("options: ['-v/:/host']", "options"),
    ("options: ['--user', '0']", "options"),
    ("options: ['--userns=host']", "options"),
    ("mounts: ['/:/host']", "mounts"),
    ("mounts: ['/etc:/etc']", "mounts"),
    ("mounts: ['/var/run/docker.sock:/var/run/docker.sock']", "mounts"),
    ("mounts: ['/root/.ssh:/keys:ro']", "mounts"),
])
def test_options_that_widen_the_containers_reach_are_refused_unless_allowed(setting, key):
    document = f"nodes: [{{host: a, container: {{image: i, runtime: podman, {setting}}}}}]"
    with pytest.raises(InventoryError) as caught:
        parse_inventory(document)
    assert f"container.{key}" in str(caught.value) and "allow_privileged: true" in str(caught.value)
    allowed = parse_inventory(document.replace("runtime: podman,", "runtime: podman, allow_privileged: true,"))
    assert allowed.nodes[0].container.allow_privileged


def test_ordinary_options_and_data_mounts_need_no_privilege():
    inventory = parse_inventory("nodes: [{host: a, container: {image: i, options: ['--shm-size', '1g', '--ulimit', "
                                "'nofile=65536:65536', '-e', 'WANDB_MODE=offline'], mounts: ['/data:/data:ro', "
                                "'/scratch/ckpt:/ckpt']}}]")
    assert not inventory.nodes[0].container.allow_privileged


@pytest.mark.parametrize("runtime", ["docker", "podman", "apptainer"])
def test_the_run_folder_is_read_only_but_for_the_ranks_folders_and_state_is_hidden(runtime):
    """Root in the container can swap no folder the host acts on for a link: the run folder (node.json, the
    scripts, env.sh, lib/, config/, attempts/) is mounted read-only, the ranks' own folders are bound writable over
    it after it, and state/ is an empty read-only folder there."""
    script = rendered(runtime)
    bind = "--bind" if runtime == "apptainer" else "--volume"
    assert f'run_mounts+=({bind} "$RUN_DIR/$part:$RUN_DIR/$part:rw")' in script
    assert f'run_mounts+=({bind} "$RUN_DIR/lib/hidden:$RUN_DIR/$part:ro")' in script
    words = command_words(script, "apptainer exec" if runtime == "apptainer" else runtime)
    assert words.index("$RUN_DIR:$RUN_DIR:ro") < words.index("${run_mounts[@]}"), words
    assert "state" not in script.split("for part in ", 1)[1].split(";", 1)[0]


def test_enroot_mounts_the_run_folder_read_only_then_the_ranks_folders():
    """enroot's --mount takes fstab fields, colon-separated: the run folder's own mount with `ro` first, then the
    writable binds (in order), so they lie over it."""
    script = rendered("enroot")
    assert 'run_mounts+=(--mount "$RUN_DIR/$part:$RUN_DIR/$part:none:bind,rw")' in script
    assert 'run_mounts+=(--mount "$RUN_DIR/lib/hidden:$RUN_DIR/$part:none:bind,ro")' in script
    words = command_words(script, "enroot start")
    assert words.index("$RUN_DIR:$RUN_DIR:none:bind,ro") < words.index("${run_mounts[@]}"), words


@pytest.mark.parametrize("runtime", ["docker", "podman", "apptainer", "enroot"])
def test_an_env_option_value_goes_to_env_sh_never_to_the_command_line(runtime):
    """`ps` on the node shows the runtime's command line to every user: `-e WANDB_API_KEY=...` among the options
    becomes a variable of env.sh (0600), passed in by name."""
    document = (f"defaults: {{device: cpu, container: {{image: i, runtime: {runtime}, options: ['-e', "
                f"'WANDB_API_KEY=wk-0123456789', '--env=MODE=offline', '--shm-size', '1g']}}}}\nnodes: [{{host: a}}]")
    plan = build_plan(parse_inventory(document), gpus=1, command=("train.py",), sync_dir="/src/project",
                      run_id="20260101-000000-abcd")
    node = render_plan(plan)[0]
    assert "wk-0123456789" not in node.launch and "MODE=offline" not in node.launch
    assert "WANDB_API_KEY=wk-0123456789" in node.env and "MODE=offline" in node.env
    assert "--shm-size 1g" in node.launch
    if runtime != "apptainer":
        assert "--env WANDB_API_KEY" in node.launch and "--env MODE" in node.launch
