"""Nodes that share nothing with the controller (issue 12): each case failed on main before it was fixed.

The session cluster (conftest.SESSION_SPECS): node0 root with a noisy bash start-up, node1 a zsh user on an
sshd without sftp, node2 a fish user whose workdir is a symlink. Other tests start clusters of their own.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import paramiko
import pytest

from support.sshcluster import make_cluster

from support.cli import run_nodectl
from support.launch import kill_leftovers, latest_run_id, make_project, run_processes, via_proxycommand, wait_for
from support.sshcluster import NODE_PYTHON, NodeSpec
from support.trainer import free_port

pytestmark = pytest.mark.slow

PROBE_ISOLATION = '''\
import json, os, sys
print("SEEN " + json.dumps({p: os.path.exists(p) for p in sys.argv[1:]}), flush=True)
print(f"UID {os.getuid()}", flush=True)
'''


def launch(cluster, project, *args, indices=(0, 1), timeout=180, **inventory):
    env = cluster.env()
    return run_nodectl(["-i", str(cluster.inventory(indices=list(indices), **inventory)), "launch", *args],
                       env=env, cwd=project, timeout=timeout)


def test_a_node_sees_nothing_of_the_controller(ssh_cluster, project):
    (project / "probe.py").write_text(PROBE_ISOLATION)
    secret_places = [str(project), str(ssh_cluster.home), str(project / "runs"), sys.prefix, "/work"]
    result = launch(ssh_cluster, project, "--skip-preflight", "--follow", "all", "--", "probe.py", *secret_places,
                    indices=(0, 1, 2))
    assert result.exit_code == 0, result.output[-2000:]
    seen = [json.loads(line.split("SEEN ", 1)[1]) for line in result.stdout.splitlines() if "SEEN " in line]
    assert len(seen) == 3
    for answer in seen:
        assert not any(answer[p] for p in secret_places[:4]), answer
    uids = sorted(int(line.rsplit(" ", 1)[1]) for line in result.stdout.splitlines() if "UID " in line)
    assert uids[0] == 0 and uids[1] != 0 and uids[2] != 0   # node1 and node2 log in as users of their own


def fake_ssh(folder, body: str) -> dict:
    """An environment whose PATH finds `ssh` in `folder` first: a script with `body`, logging its calls."""
    folder.mkdir(exist_ok=True)
    (folder / "ssh").write_text(f"#!/bin/sh\necho \"$*\" >> {folder / 'calls'}\n{body}\n")
    (folder / "ssh").chmod(0o755)
    return {"PATH": f"{folder}:{os.environ['PATH']}"}


def test_the_project_streams_through_the_system_ssh_or_else_paramiko(ssh_cluster, project, tmp_path):
    (project / "weights.bin").write_bytes(os.urandom(3 << 20))
    arrived = lambda run_id: [(n.workdir / "runs" / run_id / "code" / "weights.bin").read_bytes()  # noqa: E731
                              for n in ssh_cluster.nodes[:2]]
    cases = {"system": "exec /usr/bin/ssh \"$@\"", "broken": "echo 'ssh: Bad SSH2 cipher spec' >&2; exit 255"}
    for name, body in cases.items():
        env = {**ssh_cluster.env(), **fake_ssh(tmp_path / name, body)}
        (project / "weights.bin").write_bytes(os.urandom(3 << 20))  # new content: every byte goes again
        result = run_nodectl(["-i", str(ssh_cluster.inventory(indices=[0, 1])), "launch", "--skip-preflight",
                              "--", "train.py"], env=env, cwd=project)
        assert result.exit_code == 0, (name, result.output[-2000:])
        assert arrived(latest_run_id(project)) == [(project / "weights.bin").read_bytes()] * 2
        calls = (tmp_path / name / "calls").read_text().splitlines()
        # one stream per node, strict about host keys and never prompting, to the node's address
        assert len(calls) == 2 and all("receive" in c and "StrictHostKeyChecking=yes" in c and "BatchMode=yes" in c
                                       for c in calls), calls
        assert sorted(c.split(" -- ")[1].split()[0] for c in calls) == sorted(n.address for n in
                                                                              ssh_cluster.nodes[:2])
    env = {**ssh_cluster.env(NODECTL_SYSTEM_SSH="0"), **fake_ssh(tmp_path / "off", "exit 255")}
    result = run_nodectl(["-i", str(ssh_cluster.inventory(indices=[0])), "launch", "--skip-preflight", "--",
                          "train.py"], env=env, cwd=project)
    assert result.exit_code == 0 and not (tmp_path / "off" / "calls").exists(), result.output[-2000:]


def test_launch_config_sends_the_recipe_with_the_run(ssh_cluster, project):
    (project / "recipe.yaml").write_text("data: {path: demo, max_length: 32}\n"
                                         "train: {steps: 3, log_every: 1, micro_batch_size: 2}\n")
    result = launch(ssh_cluster, project, "--skip-preflight", "--config", "recipe.yaml", indices=(0, 1), timeout=300)
    assert result.exit_code == 0, result.output[-3000:]
    run_id = latest_run_id(project)
    script = (project / "runs" / run_id / "scripts" / "node1.sh").read_text()
    assert "../config/recipe.yaml" in script and str(project) not in script
    metrics = ssh_cluster.nodes[0].workdir / "runs" / run_id / "output" / "metrics.jsonl"
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if '"loss"' in line]
    assert steps == [1, 2, 3]


def test_fixed_master_port_full_preflight_then_two_launches_in_a_row(ssh_cluster, project):
    """A fixed master port: the full preflight, then two launches on it. Node 1 has no SFTP subsystem, and files
    still travel both ways (the code there, its logs back through collect)."""
    node = ssh_cluster.nodes[1]
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
    client.connect(node.address, node.port, username=node.spec.user, key_filename=str(ssh_cluster.identity),
                   look_for_keys=False, allow_agent=False)
    try:
        with pytest.raises(paramiko.SSHException):
            client.open_sftp()
    finally:
        client.close()
    port = free_port()
    inventory = str(ssh_cluster.inventory(indices=[0, 1], master_port=port))
    env = ssh_cluster.env()
    preflight = run_nodectl(["-i", inventory, "--json", "preflight", "--full"], env=env, cwd=project, timeout=300)
    assert preflight.exit_code == 0, preflight.output[-3000:]
    (project / "tokens.bin").write_bytes(os.urandom(1 << 20))  # new content for the first launch to send
    for attempt in range(2):
        result = run_nodectl(["-i", inventory, "launch", "--", "train.py"], env=env, cwd=project)
        assert result.exit_code == 0, (attempt, result.output[-3000:])
        assert f"master {ssh_cluster.nodes[0].address}:{port}" in result.stderr
        # the user hears when the code is on every node, and a launch that changed nothing sends nothing
        ready = re.search(r"code ready on 2 node\(s\) in [\d.]+s \(([\d.]+) (B|KiB|MiB|GiB) sent\)", result.stderr)
        assert ready and ((ready[2] == "MiB" and float(ready[1]) >= 1.0) if attempt == 0 else ready[0].endswith(
            "(0 B sent)")), result.stderr[-2000:]
    # preflight's own collective job is never "the latest run"
    def here(document):  # the registry also lists other tests' runs (the same HOME): only this project's
        return [r for r in document["runs"] if r["folder"].startswith(str(project))]

    runs = here(run_nodectl(["--json", "runs"], env=env, cwd=project).json())
    assert [r["kind"] for r in runs] == ["train", "train"]
    every = here(run_nodectl(["--json", "runs", "--all"], env=env, cwd=project).json())
    assert any(r["kind"] == "preflight" for r in every)
    status = run_nodectl(["--json", "status"], env=env, cwd=project).json()
    assert status["run_id"] == runs[-1]["run_id"] and status["state"] == "succeeded"

    run_id = runs[-1]["run_id"]
    assert (node.workdir / "runs" / run_id / "code" / "train.py").is_file()
    collected = run_nodectl(["-i", inventory, "collect"], env=env, cwd=project)
    assert collected.exit_code == 0, collected.output
    assert "rank=1" in (project / "runs" / run_id / "nodes" / "node1" / "logs" / "rank1.log").read_text()
    # torchrun's own logs stay in the run folder, not in the node's /tmp forever
    assert (node.workdir / "runs" / run_id / "torchelastic").is_dir()
    listing = ssh_cluster.on_node(1, "ls -a /tmp")
    assert listing.returncode == 0 and "torchelastic_" not in listing.stdout, listing


def test_ctrl_c_during_sync_exits_130_and_leaves_nothing_on_the_nodes(ssh_cluster, project):
    (project / "weights.bin").write_bytes(b"\0" * (384 << 20))  # long enough to be interrupted mid-send
    env = ssh_cluster.env()
    inventory = str(ssh_cluster.inventory(indices=[0, 1]))
    proc = subprocess.Popen([sys.executable, "-m", "nodectl", "-i", inventory, "launch", "--skip-preflight",
                             "--sync-limit", "1024", "--", "train.py"], env=env, cwd=project,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stores = [n.workdir / ".nodectl" / "objects" for n in ssh_cluster.nodes[:2]]

    def uploading():  # an object is arriving: the node's tar unpacks it in a folder of its own first
        return any(p.is_file() for store in stores if store.is_dir() for p in store.glob(".incoming-*/*"))

    try:
        wait_for(uploading, timeout=120, interval=0.02)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    run_id = latest_run_id(project)
    kill_leftovers(run_id)
    assert proc.returncode == 130, err[-2000:]
    assert "Aborted" not in err and "Traceback" not in err
    assert run_processes(run_id) == []
    for node in ssh_cluster.nodes[:2]:
        assert not (node.workdir / "runs" / run_id / "state" / "pgid").exists()   # never started
        leftovers = [p.name for p in node.workdir.rglob("*") if p.name.endswith(".tmp") or "upload-" in p.name
                     or p.name.startswith(".incoming-")]
        assert leftovers == [], leftovers
    manifest = json.loads((project / "runs" / run_id / "manifest.json").read_text())
    assert manifest["state"] == "interrupted"


def test_sigterm_during_preflight_stops_its_collective_job(ssh_cluster, tmp_path):
    env = ssh_cluster.env()
    inventory = str(ssh_cluster.inventory(indices=[0, 1], gpus=2))
    proc = subprocess.Popen([sys.executable, "-m", "nodectl", "-i", inventory, "preflight"], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    runs = tmp_path / "runs"
    try:
        run_id = wait_for(lambda: runs.is_dir() and [p.name for p in runs.iterdir() if p.name[0].isdigit()], 120)[0]
        wait_for(lambda: len(run_processes(run_id)) >= 2, timeout=60, interval=0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    kill_leftovers(run_id)
    assert proc.returncode == 130, err[-2000:]
    assert run_processes(run_id) == []


def test_resume_refuses_a_live_run_and_resumes_after_a_preflighted_attempt(ssh_cluster, project):
    env = ssh_cluster.env()
    inventory = str(ssh_cluster.inventory(indices=[0, 1], env={"SLEEP": "120"}))
    detached = run_nodectl(["-i", inventory, "--json", "launch", "--detach", "--", "train.py"], env=env, cwd=project)
    assert detached.exit_code == 0, detached.output[-2000:]
    document = detached.json()
    run_id = document["run_id"]
    assert document["state"] == "running" and set(document["nodes"]) == {"node0", "node1"}
    try:
        wait_for(lambda: len(run_processes(run_id)) >= 8)  # per node: launch.sh, torchrun, rankexec, train.py
        before = sorted(p.pid for p in run_processes(run_id))
        refused = run_nodectl(["-i", inventory, "launch", "--resume", run_id], env=env, cwd=project)
        assert refused.exit_code == 2 and "still running" in refused.stderr, refused.output[-2000:]
        assert sorted(p.pid for p in run_processes(run_id)) == before   # untouched
        assert run_nodectl(["stop", "--run", run_id, "--grace", "2"], env=env, cwd=project).exit_code == 0
        inventory = str(ssh_cluster.inventory(indices=[0, 1], env={"SLEEP": "0.2"}))
        resumed = run_nodectl(["-i", inventory, "launch", "--resume", run_id], env=env, cwd=project)
        assert resumed.exit_code == 0, resumed.output[-2000:]
        assert (project / "runs" / run_id / "preflight-1.json").is_file()
    finally:
        kill_leftovers(run_id)


def test_stop_after_a_reboot_never_kills_a_process_reusing_the_recorded_group(ssh_cluster, project):
    env = ssh_cluster.env()
    inventory = str(ssh_cluster.inventory(indices=[0, 1], env={"SLEEP": "120"}))
    assert run_nodectl(["-i", inventory, "launch", "--skip-preflight", "--detach", "--", "train.py"], env=env,
                       cwd=project).exit_code == 0
    run_id = latest_run_id(project)
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True,
                                env={k: v for k, v in os.environ.items() if not k.startswith("NODECTL")})
    try:
        wait_for(lambda: len(run_processes(run_id)) >= 4)
        for proc in run_processes(run_id):  # the "reboot": every process of the run gone, no exit recorded
            proc.kill()
        wait_for(lambda: run_processes(run_id) == [])
        pgid_file = ssh_cluster.nodes[0].workdir / "runs" / run_id / "state" / "pgid"
        pgid_file.write_text(str(os.getpgid(stranger.pid)))   # after the reboot the number is someone else's
        for node in ssh_cluster.nodes[:2]:   # and the kernel's boot id is a new one
            (node.workdir / "runs" / run_id / "state" / "boot").write_text("00000000-0000-0000-0000-000000000000")
        status = run_nodectl(["--json", "status", "--run", run_id], env=env, cwd=project).json()
        assert status["state"] == "lost" and {r["state"] for r in status["ranks"]} == {"lost"}
        stopped = run_nodectl(["stop", "--run", run_id, "--grace", "1"], env=env, cwd=project)
        assert stopped.exit_code == 0, stopped.output
        assert stranger.poll() is None, "stop killed a process that is not the run's"
    finally:
        stranger.kill()
        kill_leftovers(run_id)


def test_symlinked_workdir_node(ssh_cluster, project):
    result = launch(ssh_cluster, project, "--skip-preflight", "--", "train.py", indices=(0, 2))
    assert result.exit_code == 0, result.output[-2000:]
    run_id = latest_run_id(project)
    real = ssh_cluster.nodes[2].home_dir / "data" / "nodectl" / "runs" / run_id
    assert "rank=1 world=2" in (real / "logs" / "rank1.log").read_text()


def test_unwritable_workdir_missing_python_and_unresolvable_addr_are_named(ssh_cluster, project):
    env = ssh_cluster.env()
    overrides = {0: {"python": "/opt/nowhere/bin/python3"}, 1: {"workdir": "/opt/venv/not-mine"}}
    inventory = str(ssh_cluster.inventory(indices=[0, 1], node_overrides=overrides))
    result = run_nodectl(["-i", inventory, "preflight", "--quick"], env=env, cwd=project)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output[-3000:]
    assert "FAIL node0 python" in result.stdout and "/opt/nowhere/bin/python3" in result.stdout
    assert "FAIL node1 workdir" in result.stdout and "/opt/venv/not-mine" in result.stdout
    for index, expected in ((0, "was not found on the node"), (1, "cannot be written")):
        one = str(ssh_cluster.inventory(indices=[0, 1], node_overrides={index: overrides[index]}))
        skipped = run_nodectl(["-i", one, "launch", "--skip-preflight", "--", "train.py"], env=env, cwd=project)
        assert skipped.exit_code == 1 and "Traceback" not in skipped.output, skipped.output[-3000:]
        assert f"node{index}" in skipped.stderr and expected in skipped.stderr, skipped.stderr

    unresolvable = str(ssh_cluster.inventory(indices=[0, 1], node_overrides={0: {"addr": "no-such-node.invalid"}}))
    result = run_nodectl(["-i", unresolvable, "--json", "preflight", "--quick"], env=env, cwd=project)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output[-3000:]
    failed = {(r["node"], r["check"]) for r in result.json()["results"] if r["verdict"] == "fail"}
    assert ("node1", "reach master") in failed


def test_run_state_is_right_and_runs_are_found_from_any_folder(ssh_cluster, project, tmp_path):
    env = ssh_cluster.env()
    inventory = str(ssh_cluster.inventory(indices=[0, 1], env={"SLEEP": "3"}))
    detached = run_nodectl(["-i", inventory, "--json", "launch", "--skip-preflight", "--detach", "--", "train.py"],
                           env=env, cwd=project)
    run_id = detached.json()["run_id"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    try:
        wait_for(lambda: run_nodectl(["--json", "status", "--run", run_id], env=env, cwd=elsewhere).json()["state"]
                 == "succeeded", timeout=60, interval=1)
        runs = run_nodectl(["--json", "runs"], env=env, cwd=elsewhere).json()["runs"]
        assert [r["state"] for r in runs if r["run_id"] == run_id] == ["succeeded"]
        tail = run_nodectl(["--json", "tail", "rank1", "--run", run_id], env=env, cwd=elsewhere)
        assert tail.exit_code == 0, tail.output
        lines = tail.json()["lines"]
        assert any("rank=1 world=2" in entry["line"] for entry in lines) and lines[0]["node"] == "node1"
    finally:
        kill_leftovers(run_id)

    # an attached controller killed outright: the nodes still tell the truth afterwards
    proc = subprocess.Popen([sys.executable, "-m", "nodectl", "-i", inventory, "launch", "--skip-preflight", "--",
                             "train.py"], env=env, cwd=project, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run_id = wait_for(lambda: (project / "runs" / latest_run_id(project) / "manifest.json").is_file()
                      and latest_run_id(project) != detached.json()["run_id"] and latest_run_id(project))
    try:
        wait_for(lambda: json.loads((project / "runs" / run_id / "manifest.json").read_text())["state"] == "running")
        proc.kill()
        proc.wait()
        wait_for(lambda: run_processes(run_id) == [], timeout=60)
        runs = run_nodectl(["--json", "runs"], env=env, cwd=project).json()["runs"]
        assert {r["run_id"]: r["state"] for r in runs}[run_id] == "succeeded"
    finally:
        kill_leftovers(run_id)


def test_a_home_shared_by_two_nodes_gives_each_its_own_run_folder(tmp_path_factory, tmp_path):
    cluster = make_cluster(tmp_path_factory, 2, first_octet=40, specs={1: NodeSpec(share_home_with=0)})
    cluster.trust_host_keys()
    try:
        project = make_project(tmp_path / "project")
        result = launch(cluster, project, "--skip-preflight", "--", "train.py", indices=(0, 1))
        assert result.exit_code == 0, result.output[-2000:]
        assert "share a workdir" in result.stderr
        run_id = latest_run_id(project)
        shared = cluster.nodes[0].workdir / "runs" / run_id
        assert "rank=0 world=2" in (shared / "node0" / "logs" / "rank0.log").read_text()
        assert "rank=1 world=2" in (shared / "node1" / "logs" / "rank1.log").read_text()
    finally:
        cluster.stop()


BLACKHOLE_PORT = 2222


def test_proxyjump_checks_the_bastion_key_and_honours_the_timeout(tmp_path_factory, tmp_path):
    cluster = make_cluster(tmp_path_factory, 2, first_octet=30, names=["node0", "bastion"])
    target, bastion = cluster.nodes
    ssh_dir = cluster.home / ".ssh"
    (ssh_dir / "config").write_text(
        f"Host jumped\n  HostName {target.address}\n  Port {target.port}\n  User root\n"
        f"  IdentityFile {cluster.identity}\n  ProxyJump root@{bastion.address}:{bastion.port}\n"
        f"Host holed\n  HostName {target.address}\n  Port {target.port}\n  User root\n"
        f"  IdentityFile {cluster.identity}\n  ProxyJump root@127.0.0.39:{BLACKHOLE_PORT}\n"
        f"Host {bastion.address} 127.0.0.39\n  IdentityFile {cluster.identity}\n")
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text("defaults: {device: cpu, python: /opt/venv/bin/python}\nnodes:\n  - host: jumped\n")
    known = ssh_dir / "known_hosts"
    target_line, bastion_line = cluster.known_hosts_lines()
    env = cluster.env()
    try:
        known.write_text(target_line + "\n")          # the bastion's key was never verified
        result = run_nodectl(["-i", str(inventory), "env-dump"], env=env)
        assert result.exit_code == 3 and f"unknown host key for [{bastion.address}]:2222" in result.stderr, (known.read_text(), result.output)

        wrong = bastion_line.split()[0] + " " + " ".join(target_line.split()[1:])
        known.write_text(f"{target_line}\n{wrong}\n")   # a WRONG key for the bastion
        result = run_nodectl(["-i", str(inventory), "env-dump"], env=env)
        assert result.exit_code == 3 and "HOST KEY CHANGED" in result.stderr
        assert f"ssh-keygen -R '[{bastion.address}]:2222'" in result.stderr

        revoked_ca = f"@cert-authority *.example.com {' '.join(target_line.split()[1:])}"
        known.write_text(f"{revoked_ca}\n{target_line}\n{bastion_line}\n")
        result = run_nodectl(["-i", str(inventory), "--json", "env-dump"], env=env)
        assert result.exit_code == 0, result.output[-2000:]
        assert result.json()["nodes"]["jumped"]["python"]["version"]

        known.write_text(f"{target_line}\n{bastion_line}\n@revoked * {' '.join(bastion_line.split()[1:])}\n")
        result = run_nodectl(["-i", str(inventory), "env-dump"], env=env)
        assert result.exit_code == 3 and "@revoked" in result.stderr and "Traceback" not in result.stderr

        with socket.socket() as hole:   # a bastion that never answers: its backlog full, SYNs dropped
            hole.bind(("127.0.0.39", BLACKHOLE_PORT))
            hole.listen(0)
            fillers = [socket.socket() for _ in range(3)]
            for filler in fillers:
                filler.setblocking(False)
                filler.connect_ex(("127.0.0.39", BLACKHOLE_PORT))
            inventory.write_text("defaults: {device: cpu}\nnodes:\n  - host: holed\n")
            started = time.monotonic()
            result = run_nodectl(["-i", str(inventory), "--connect-timeout", "2", "env-dump"], env=env, timeout=120)
            elapsed = time.monotonic() - started
            for filler in fillers:
                filler.close()
        assert result.exit_code == 3 and "timed out" in result.stderr, result.output[-2000:]
        assert elapsed < 20, elapsed
    finally:
        cluster.stop()




def test_proxycommand_is_honoured_by_paramiko_and_by_the_system_ssh_stream(tmp_path_factory, tmp_path):
    """~/.ssh/config's ProxyCommand fronts a HostName nothing can reach directly (192.0.2.1, TEST-NET): env-dump
    and a launch work only through the command, and the sync's system ssh is given the alias, not the address,
    so it applies the same Host block (before, paramiko dialled 192.0.2.1 and the stream bypassed bastions)."""
    cluster = make_cluster(tmp_path_factory, 1, first_octet=34)
    [target] = cluster.nodes
    via_proxycommand(cluster, target, tmp_path)
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(f"defaults: {{device: cpu, python: {NODE_PYTHON}}}\nnodes:\n  - {{host: viacmd, name: n0, addr: {target.address}}}\n")
    env = cluster.env()
    try:
        dumped = run_nodectl(["-i", str(inventory), "--connect-timeout", "5", "--json", "env-dump"], env=env,
                             timeout=120)
        assert dumped.exit_code == 0, dumped.output[-2000:]
        assert dumped.json()["nodes"]["n0"]["python"]["version"]
        project = make_project(tmp_path / "project")
        (project / "weights.bin").write_bytes(os.urandom(1 << 20))
        env = {**env, **fake_ssh(tmp_path / "ssh", "exec /usr/bin/ssh \"$@\"")}
        launched = run_nodectl(["-i", str(inventory), "--connect-timeout", "5", "launch", "--skip-preflight", "--",
                                "train.py"], env=env, cwd=project, timeout=180)
        assert launched.exit_code == 0, launched.output[-2000:]
        calls = (tmp_path / "ssh" / "calls").read_text().splitlines()
        assert calls and all(c.split(" -- ")[1].split()[0] == "viacmd" for c in calls), calls
        arrived = target.workdir / "runs" / latest_run_id(project) / "code" / "weights.bin"
        assert arrived.read_bytes() == (project / "weights.bin").read_bytes()
    finally:
        cluster.stop()


def test_over_long_names_and_host_labels_are_inventory_errors(tmp_path):
    for node in ({"host": "a" * 64 + ".example.com"}, {"host": "h1", "name": "n" * 300}):
        inventory = tmp_path / "hosts.yaml"
        inventory.write_text(json.dumps({"nodes": [node]}))
        result = run_nodectl(["-i", str(inventory), "env-dump"], env={**os.environ, "HOME": str(tmp_path)})
        assert result.exit_code == 2 and "Traceback" not in result.output and "nodes[0]" in result.stderr


def test_commands_mean_the_same_under_sh_bash_zsh_and_fish(ssh_cluster, fresh_cluster, tmp_path):
    from nodectl.inventory import load_inventory
    from nodectl.transport import Cluster, TransportOptions

    fresh_cluster.trust_host_keys()
    tricky = "a\\\\b 'single' \"double\" $HOME `x` ; done"
    command = f"printf '%s|%s' {__import__('shlex').quote(tricky)} \"$HOME\"; echo; echo oops >&2; exit 3"
    for cluster in (ssh_cluster, fresh_cluster):
        os.environ["HOME"] = str(cluster.home)   # this process connects, with the cluster's known_hosts
        inventory = load_inventory(cluster.inventory())
        with Cluster(inventory.nodes, TransportOptions()) as nodes:
            results = nodes.fan_out(lambda t: t.run(command))
        for result, node in zip(results, cluster.nodes):
            assert result.ok, result.error
            lines = result.value.stdout.splitlines()
            assert lines[-1] == f"{tricky}|{node.home}", (node.spec.shell, lines)  # after any banner
            assert result.value.exit_code == 3 and "oops" in result.value.stderr


def test_fan_out_turns_every_failure_into_that_nodes_result(tmp_path):
    from nodectl.remote.agent import AgentError
    from nodectl.inventory import parse_inventory
    from nodectl.transport import Cluster

    inventory = parse_inventory("nodes: [{host: a, transport: local}, {host: b, transport: local}, "
                                "{host: c, transport: local}]")

    def work(transport):
        if transport.node.name == "a":
            raise AgentError("a: runctl said no")
        if transport.node.name == "b":
            raise RuntimeError("surprise")
        return "fine"

    with Cluster(inventory.nodes) as nodes:
        results = nodes.fan_out(work)
    assert [r.error for r in results] == ["a: runctl said no", "RuntimeError: surprise", None]
    assert results[2].value == "fine"
    assert results.succeeded == {"c": "fine"} and [r.node.name for r in results.failed] == ["a", "b"]
    assert [r.failure.kind for r in results.failed] == ["answered", "internal"]


def test_a_node_that_resets_the_connection_is_one_line_not_a_traceback(tmp_path):
    import threading

    with socket.socket() as server:
        server.bind(("127.0.0.45", 0))
        server.listen(8)
        port = server.getsockname()[1]

        def reset_all():
            for _ in range(4):
                try:
                    conn, _ = server.accept()
                except OSError:
                    return
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
                conn.close()

        threading.Thread(target=reset_all, daemon=True).start()
        inventory = tmp_path / "hosts.yaml"
        inventory.write_text(f"nodes: [{{host: 127.0.0.45, port: {port}}}]\n")
        result = run_nodectl(["-i", str(inventory), "--accept-new-host-keys", "env-dump"],
                             env={**os.environ, "HOME": str(tmp_path)})
    assert result.exit_code == 3, result.output
    assert "Traceback" not in result.stderr and "127.0.0.45" in result.stderr


HANG_PYTHON = '''#!/bin/sh
# A node whose commands hang while TCP stays up (a login shell stuck on a hung NFS home): once ~/hang exists,
# every new interpreter nodectl starts there blocks.
[ -e "$HOME/hang" ] && exec sleep 1717
exec /opt/venv/bin/python "$@"
'''


def _kill_hung_sleeps() -> None:
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        if (proc.info["cmdline"] or [])[:2] == ["sleep", "1717"]:
            proc.kill()


def test_a_hung_node_never_delays_a_failure_elsewhere_and_is_lost_only_when_its_stream_falls_silent(ssh_cluster, project):
    env = ssh_cluster.env()
    python = ssh_cluster.node_file(1, "hanging-python", HANG_PYTHON, mode=0o755)
    marker = ssh_cluster.nodes[1].home_dir / "hang"
    overrides = {0: {"env": {"FAIL_RANK": "0", "FAIL_AFTER": "3", "SLEEP": "120"}},
                 1: {"python": python, "env": {"SLEEP": "120"}}}
    inventory = str(ssh_cluster.inventory(indices=[0, 1], node_overrides=overrides))
    proc = subprocess.Popen([sys.executable, "-m", "nodectl", "-i", inventory, "--connect-timeout", "10", "launch",
                             "--skip-preflight", "--grace", "1", "--", "train.py"], env=env, cwd=project,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run_id = wait_for(lambda: (project / "runs").is_dir() and latest_run_id(project))
        log = ssh_cluster.nodes[0].workdir / "runs" / run_id / "logs" / "rank0.log"
        wait_for(lambda: log.exists() and "ARGS=" in log.read_text(), timeout=60, interval=0.1)
        marker.write_text("")            # from now on node1's commands hang
        exit_file = ssh_cluster.nodes[0].workdir / "runs" / run_id / "ranks" / "rank0.exit"
        wait_for(exit_file.exists, timeout=60, interval=0.05)
        failed_at = time.monotonic()
        out, err = proc.communicate(timeout=120)
        reported = time.monotonic() - failed_at
    finally:
        proc.kill()
        marker.unlink(missing_ok=True)
        _kill_hung_sleeps()
    kill_leftovers(run_id)
    assert proc.returncode == 1, err[-2000:]
    assert "rank 0 on node node0 failed (exit code 7)" in err
    assert "node1 is not answering" in err
    assert reported < 20, reported     # was 30-50 s: every poll and the stop waited for the hung node

    # the hung node alone: its watcher stopped too (its stream silent while its SSH port answers, every new
    # command hanging): not lost at the first silence past its usual, as a poll's time-out made it, but after twice
    # --lost-after (and three times its longest silence), said as hanging commands
    overrides = {0: {"env": {"SLEEP": "120"}}, 1: {"python": python, "env": {"SLEEP": "120"}}}
    inventory = str(ssh_cluster.inventory(indices=[0, 1], node_overrides=overrides))
    proc = subprocess.Popen([sys.executable, "-m", "nodectl", "-i", inventory, "--connect-timeout", "10", "launch",
                             "--skip-preflight", "--grace", "1", "--lost-after", "5", "--", "train.py"], env=env,
                            cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watcher = []
    try:
        run_id = wait_for(lambda: latest_run_id(project) != run_id and latest_run_id(project))
        wait_for(lambda: len(run_processes(run_id)) >= 8, timeout=60)
        watcher = wait_for(lambda: _watchers(run_id, ssh_cluster.nodes[1].spec.user), timeout=30)
        marker.write_text("")
        for process in watcher:
            process.suspend()
        hung_at = time.monotonic()
        out, err = proc.communicate(timeout=120)
        detected = time.monotonic() - hung_at
    finally:
        proc.kill()
        for process in watcher:
            process.kill()
        marker.unlink(missing_ok=True)
        _kill_hung_sleeps()
    kill_leftovers(run_id)
    assert proc.returncode == 1 and "node node1 was lost: no word for" in err, err[-2000:]
    assert "its SSH port answers (its commands hang" in err, err[-2000:]
    assert 10 <= detected < 60, detected


def _watchers(run_id: str, user: str) -> list:
    """The run's watcher on the node of `user` (runctl watch, started by the attached launch)."""
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline", "username"]):
        line = process.info["cmdline"] or []
        if process.info["username"] == user and "watch" in line and any(run_id in part for part in line):
            found.append(process)
    return found
