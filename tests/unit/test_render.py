"""Rendered launch scripts: golden files, quoting that no value escapes, and template errors."""
from __future__ import annotations

import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from nodectl.remote.answers import IdentityAnswer
from nodectl.errors import UsageError
from nodectl.inventory import parse_inventory
from nodectl.plan import build_plan
from nodectl.render import render_plan

GOLDEN = Path(__file__).parent / "golden"
INVENTORY = """\
master_port: 29500
defaults: {user: ubuntu, gpus: 8, python: /opt/venv/bin/python3, workdir: ~/nodectl,
           env: {NCCL_SOCKET_IFNAME: ens1, HF_TOKEN: hf_secret_value}}
nodes:
  - {host: 10.0.0.11, name: node0, addr: 10.0.1.11}
  - {host: 10.0.0.12, name: node1}
"""


def plan(command=("train.py", "--lr", "3e-4")):
    inventory = parse_inventory(INVENTORY)
    p = build_plan(inventory, gpus=None, command=command, sync_dir="/src/project", run_id="20260101-000000-abcd",
                   facts={"node0": {"cpu": {"available": 64}, "torch": {"version": "2.6.0+cu124"}}})
    return replace(p, created=0.0)


@pytest.mark.parametrize("node", [0, 1])
def test_golden_launch_scripts(node):
    rendered = render_plan(plan())[node]
    golden = GOLDEN / f"launch_node{node}.sh"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(rendered.launch)
        (GOLDEN / f"env_node{node}.sh").write_text(rendered.env_redacted)
    assert rendered.launch == golden.read_text()
    assert rendered.env_redacted == (GOLDEN / f"env_node{node}.sh").read_text()


def test_secrets_only_in_the_real_env_file():
    rendered = render_plan(plan())[0]
    assert "hf_secret_value" in rendered.env
    assert "hf_secret_value" not in rendered.launch + rendered.env_redacted


def test_hostile_values_stay_literal_in_bash(tmp_path):
    canary = tmp_path / "canary"
    hostile = ("run.py", f"$(touch {canary})", f"`touch {canary}`", "a'b\"c", "x;touch " + str(canary), "line\nbreak")
    rendered = render_plan(plan(hostile))[0]
    arguments = rendered.launch.split('rankexec.py"', 1)[1]  # to the end: the newline argument spans lines
    printed = subprocess.run(["bash", "-c", "printf '%s\\0' " + arguments], capture_output=True, text=True)
    assert printed.stdout.split("\0")[:-1] == list(hostile)
    env_file = tmp_path / "env.sh"
    env_file.write_text(render_plan(replace(plan(), nodes=tuple(
        replace(n, env={**n.env, "EVIL": f"$(touch {canary})"}) for n in plan().nodes)))[0].env)
    out = subprocess.run(["bash", "-c", f"set -a; . {env_file}; printf %s \"$EVIL\""], capture_output=True, text=True)
    assert out.stdout == f"$(touch {canary})" and not canary.exists()


def test_user_template_with_undefined_variable_fails_with_its_name(tmp_path):
    template = tmp_path / "mine.sh.j2"
    template.write_text("#!/bin/bash\necho {{ plan.run_id | q }} {{ no_such_thing }}\n")
    with pytest.raises(UsageError, match="no_such_thing"):
        render_plan(plan(), str(template))
    template.write_text("#!/bin/bash\necho {{ np.node.name | q }}\n")
    assert render_plan(plan(), str(template))[1].launch == "#!/bin/bash\necho node1\n"


def test_local_nodes_share_out_the_gpus_this_process_may_use(monkeypatch):
    from nodectl.inventory import builtin_inventory

    inventory = builtin_inventory(2)
    inventory = replace(inventory, nodes=tuple(replace(n, device="cuda", gpus=1) for n in inventory.nodes))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    envs = [n.env["CUDA_VISIBLE_DEVICES"] for n in build_plan(inventory, gpus=2, command=("t.py",), sync_dir=".").nodes]
    assert envs == ["0,1", "2,3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5")
    envs = [n.env["CUDA_VISIBLE_DEVICES"] for n in build_plan(inventory, gpus=1, command=("t.py",), sync_dir=".").nodes]
    assert envs == ["2", "3"]
    with pytest.raises(UsageError, match="local nodes need 4 GPUs; CUDA_VISIBLE_DEVICES=2,3,5 offers 3"):
        build_plan(inventory, gpus=2, command=("t.py",), sync_dir=".")
    # preflight probes each local node with the same share, so it judges the GPUs that node's ranks will use;
    # an inventory's own CUDA_VISIBLE_DEVICES wins
    from nodectl.plan import visible_devices

    assert visible_devices(inventory, 1) == {"local0": "2", "local1": "3"}
    pinned = replace(inventory, nodes=(replace(inventory.nodes[0], env={"CUDA_VISIBLE_DEVICES": "5"}),
                                       inventory.nodes[1]))
    assert visible_devices(pinned, 1) == {"local0": "5"}  # one local node left to share out: it gets no share


class _AnsweringCluster:
    """Answers the run-folder identity question from a script: one list of answers per node, used in order
    (a string is an error, `Unreachable` a dead node)."""

    def __init__(self, answers):
        self.answers = {name: list(seq) for name, seq in answers.items()}
        self.asked = []

    def fan_out(self, work, nodes):
        from nodectl.transport import FanOut, NodeResult

        results = FanOut()
        for node in nodes:
            self.asked.append(node.name)
            answer = self.answers[node.name].pop(0)
            if answer is Unreachable:
                results.append(NodeResult.failed(node, "connection refused", "unreachable"))
            elif answer.startswith("error"):
                results.append(NodeResult.failed(node, answer))
            else:
                results.append(NodeResult(node, value=IdentityAnswer(answer, "/w")))
        return results


class Unreachable:
    pass


def test_a_shared_home_is_found_even_when_a_node_answers_only_the_second_time():
    from nodectl.launch.nodes import survey

    cluster = _AnsweringCluster({"node0": ["same"], "node1": ["error: Socket is closed", "same"]})
    assert survey(plan(), cluster).shared == {"node0", "node1"}
    assert cluster.asked == ["node0", "node1", "node1"]
    apart = _AnsweringCluster({"node0": ["a"], "node1": ["b"]})
    assert survey(plan(), apart).shared == frozenset()


@pytest.mark.parametrize("answer, error, words", [
    ("error: no JSON", "NodectlError", "cannot tell whether the nodes share their workdir: node1: error: no JSON"),
    (Unreachable, "UnreachableError", "node1: connection refused"),
])
def test_a_node_that_never_says_whether_it_shares_its_workdir_stops_the_launch(answer, error, words):
    from nodectl.launch.nodes import survey

    cluster = _AnsweringCluster({"node0": ["same"], "node1": [answer, answer]})
    with pytest.raises(Exception) as raised:
        survey(plan(), cluster).shared
    assert type(raised.value).__name__ == error and words in str(raised.value.message)


def test_a_cuda_node_without_gpus_runs_one_rank_per_gpu_its_probe_saw():
    """hosts.yaml without gpus: (and no --gpus) promised "as many as the node has"; launch and preflight's
    collective ran one rank per node on 8-GPU nodes. Now the probe's count decides; --gpus and gpus: still win."""
    inventory = parse_inventory("nodes:\n  - {host: a}\n  - {host: b, gpus: 2}\n  - {host: c, device: cpu}\n")
    facts = {name: {"gpus": {"count": 8}} for name in ("a", "b", "c")}
    ranks = lambda **kw: [n.nproc for n in build_plan(inventory, command=("t.py",), sync_dir=".", **kw).nodes]  # noqa
    with pytest.raises(UsageError):  # one run mixes no backends: cuda and cpu nodes are refused together
        ranks(gpus=None, facts=facts)
    inventory = parse_inventory("nodes:\n  - {host: a}\n  - {host: b, gpus: 2}\n")
    assert ranks(gpus=None, facts=facts) == [8, 2]
    assert ranks(gpus=4, facts=facts) == [4, 4]
    assert ranks(gpus=None, facts={}) == [1, 2]          # --skip-preflight: nothing probed, one rank


def test_nodes_of_one_machine_share_its_cpus_between_their_ranks(monkeypatch):
    """Each node divided its own CPUs by its own ranks: local "nodes", containers or namespaces of one kernel then
    ran a thread per core each and spun against each other (the 2-core demo took 45 s, not 12). The ranks of every
    node on the same boot id whose CPU set meets a node's own now share it."""
    inventory = parse_inventory("nodes:\n  - {host: a, gpus: 2}\n  - {host: b, gpus: 2}\n  - {host: c, gpus: 2}\n"
                                "  - {host: d, gpus: 1}\n")

    def cpu(boot, cpus):
        return {"cpu": {"available": len(cpus), "cpu_set": list(cpus), "boot_id": boot}}

    facts = {"a": cpu("k1", range(16)), "b": cpu("k1", range(8, 16)), "c": cpu("k1", range(16, 32)),
             "d": cpu("k2", range(16))}
    envs = {n.node.name: n.env["OMP_NUM_THREADS"]
            for n in build_plan(inventory, gpus=None, command=("t.py",), sync_dir=".", facts=facts).nodes}
    # a's 16 CPUs hold its 2 ranks and b's 2; b's 8 the same 4; c shares the kernel but not a CPU; d is elsewhere
    assert envs == {"a": "4", "b": "2", "c": "8", "d": "16"}
    # a probe from before cpu_set: the node's own CPUs over its own ranks, as it always was
    envs = {n.node.name: n.env.get("OMP_NUM_THREADS")
            for n in build_plan(inventory, gpus=None, command=("t.py",), sync_dir=".",
                                facts={"a": {"cpu": {"available": 6}}, "b": {"cpu": {"available": 6}}}).nodes}
    assert envs == {"a": "3", "b": "3", "c": None, "d": None}

    from nodectl.inventory import builtin_inventory

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)))
    local = builtin_inventory(2)
    assert [n.env["OMP_NUM_THREADS"] for n in build_plan(local, gpus=1, command=("t.py",), sync_dir=".").nodes] \
        == ["3", "3"], "two local nodes of one rank on 6 CPUs: 3 threads each, with --skip-preflight too"
