"""Ranks inside container images (hosts.yaml `container:`), for real: podman with runc on the isolated SSH
nodes, an image built here from a Debian root filesystem with torch CPU (tests/support/images.py, cached between runs).

Each node's sshd lives in its own mount namespace and logs in as root, so podman there is the node's podman: the
run folder it mounts into the container is the node's, which the controller cannot see. The nodes share this
machine's image store, as nodes of a cluster each hold the same image.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from support import images
from support.sshcluster import make_cluster
from support.cli import run_nodectl
from support.launch import kill_leftovers, latest_run_id, run_processes, wait_for

pytestmark = pytest.mark.slow

PROBE = '''\
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
total = torch.tensor([rank + 1.0]); dist.all_reduce(total)
inside = os.path.exists("/run/.containerenv")
print(f"rank={rank} sum={total.item():g} inside={inside} python={sys.executable} torch={torch.__version__} "
      f"pid={os.getpid()} secret={os.environ.get('MY_TOKEN') == 'tok-123'}", flush=True)
if os.environ.get("FAIL_RANK") == str(rank):
    time.sleep(1)
    sys.exit(7)
time.sleep(float(os.environ.get("SLEEP", "0.2")))
dist.barrier()
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def image():
    why = images.available()
    if why:
        pytest.skip(why)
    return images.build()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, image):
    cluster = make_cluster(tmp_path_factory, 2, first_octet=50)
    cluster.trust_host_keys()
    yield cluster
    cluster.stop()


@pytest.fixture
def project(project):
    (project / "probe.py").write_text(PROBE)
    return project


def containers_of(run_id: str) -> list[str]:
    """Containers of this run, on this machine's podman (every simulated node's)."""
    out = subprocess.run([*images.PODMAN, "ps", "-a", "--filter", f"label=nodectl.run={run_id}", "--format",
                          "{{.Names}}"], capture_output=True, text=True, check=True).stdout
    return out.split()


# This machine's kernel refuses podman 4.3's default process limit inside a container (rlimit type 6): a setting
# of the node, given as a user would give it.
OPTIONS = ["--ulimit", "nproc=32768:32768"]


def inventory(cluster, image, **node_container):
    container = {"image": image, "runtime": "podman", "options": OPTIONS, **node_container}
    return str(cluster.inventory(count=2, container=container, env={"MY_TOKEN": "tok-123"}))


def test_two_nodes_two_ranks_run_inside_the_image_read_their_pace_and_leave_nothing(cluster, image, project):
    """Four ranks on two nodes, each inside the image with its python, the node's variables passed by name. Each
    rank serves its flight recorder on a socket in its run folder, inside the container; runctl, on the host,
    reads its collectives through it (issue 51's pace), and `collect` brings the rows home, not the socket. Nothing
    is left: no container, no process. (This launch proves what two did before: the pace's was its own test.)"""
    env = cluster.env()
    inv = cluster.inventory(count=2, container={"image": image, "runtime": "podman", "options": OPTIONS},
                            env={"MY_TOKEN": "tok-123", "SLEEP": "8"})
    result = run_nodectl(["-i", str(inv), "launch", "--skip-preflight", "--gpus", "2", "--", "probe.py"], env=env,
                         cwd=project)
    run_id = latest_run_id(project)
    try:
        assert result.exit_code == 0, result.output
        assert "rank=0 sum=10 inside=True python=/usr/bin/python3" in result.stdout  # the image's python, not /opt/venv
        for rank in range(4):
            tail = run_nodectl(["tail", f"rank{rank}"], env=env, cwd=project)
            assert f"rank={rank} sum=10 inside=True" in tail.stdout and "secret=True" in tail.stdout
        assert containers_of(run_id) == []
        assert run_processes(run_id) == []
        script = (project / "runs" / run_id / "scripts" / "node1.sh").read_text()
        assert f"--name \"$CONTAINER\" --label nodectl.run={run_id}" in script and "--env MY_TOKEN" in script
        assert "tok-123" not in script   # passed by name: the value stays in env.sh (0600) on the node
        status = run_nodectl(["--json", "status"], env=env, cwd=project).json()
        assert {row["state"] for row in status["ranks"]} == {"exited(0)"}

        assert run_nodectl(["collect"], env=env, cwd=project).exit_code == 0
        for node, rank in (("node0", 0), ("node1", 3)):
            flight = project / "runs" / run_id / "nodes" / node / "flight"
            pace = json.loads((flight / f"rank{rank}.pace.json").read_text())
            assert pace["socket"] == f"rank{rank}.sock" and pace.get("copied"), pace   # read by the host's runctl
            assert [row[5] for row in pace["entries"]][:1] == ["allreduce"], pace["entries"]
            assert not list(flight.glob("*.sock"))
    finally:
        kill_leftovers(run_id)


def test_stop_fail_fast_and_ctrl_c_remove_the_containers(cluster, image, project):
    env = cluster.env()
    overrides = {0: {"env": {"SLEEP": "120", "MY_TOKEN": "tok-123"}},
                 1: {"env": {"SLEEP": "120", "FAIL_RANK": "3", "MY_TOKEN": "tok-123"}}}
    inv = str(cluster.inventory(path=project / "failing.yaml", count=2, node_overrides=overrides,
                                container={"image": image, "runtime": "podman", "options": OPTIONS}))
    base = ["-i", inventory(cluster, image), "launch", "--skip-preflight", "--gpus", "2", "--grace", "3"]
    sleepy = str(cluster.inventory(path=project / "sleepy.yaml", count=2, env={"SLEEP": "120"},
                                   container={"image": image, "runtime": "podman", "options": OPTIONS}))

    detached = run_nodectl(["-i", sleepy, *base[2:], "--detach", "--", "probe.py"], env=env, cwd=project)
    assert detached.exit_code == 0, detached.output
    run_id = latest_run_id(project)
    try:
        wait_for(lambda: len(containers_of(run_id)) == 2 and
                 "rank=3" in run_nodectl(["tail", "rank3"], env=env, cwd=project).stdout, timeout=180)
        stacks = run_nodectl(["stacks", "--run", run_id], env=env, cwd=project)
        assert stacks.exit_code == 0, stacks.output
        assert "probe.py" in stacks.stdout   # the rank's own frames, read from inside its container
        stopped = run_nodectl(["stop", "--grace", "3"], env=env, cwd=project)
        assert stopped.exit_code == 0, stopped.output
        assert containers_of(run_id) == [] and run_processes(run_id) == []
    finally:
        kill_leftovers(run_id)

    failed = run_nodectl(["-i", inv, *base[2:], "--", "probe.py"], env=env, cwd=project)
    run_id = latest_run_id(project)
    try:
        assert failed.exit_code == 1, failed.output
        assert "rank 3 on node node1 failed (exit code 7)" in failed.stderr
        assert containers_of(run_id) == [] and run_processes(run_id) == []
    finally:
        kill_leftovers(run_id)

    proc = subprocess.Popen([sys.executable, "-m", "nodectl", "-i", sleepy, *base[2:], "--", "probe.py"], env=env,
                            cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run_id = wait_for(lambda: latest_run_id(project) != run_id and latest_run_id(project))
        wait_for(lambda: len(containers_of(run_id)) == 2 and len(run_processes(run_id)) >= 6, timeout=180)
        time.sleep(1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=90)
        assert proc.returncode == 130, err
        assert containers_of(run_id) == [] and run_processes(run_id) == []
    finally:
        proc.kill()
        kill_leftovers(run_id)


@pytest.fixture(scope="module")
def older_image(image):
    """The same image with torch claiming another version: a node whose image drifted."""
    tag = image.rsplit(":", 1)[0] + ":older-torch"
    if not images.image_exists(tag):
        name = f"nodectl-test-derive-{time.time_ns()}"
        packages = "/usr/local/lib/python3.11/dist-packages"
        edit = (f"sed -i \"s/^__version__ = .*/__version__ = '2.12.1+cpu'/\" {packages}/torch/version.py && "
                f"sed -i 's/^Version: .*/Version: 2.12.1+cpu/' {packages}/torch-*.dist-info/METADATA")
        subprocess.run([*images.PODMAN, "run", "--name", name, *images.RUN_LIMITS, image, "sh", "-c", edit],
                       check=True, capture_output=True)
        subprocess.run([*images.PODMAN, "commit", "-q", name, tag], check=True, capture_output=True)
        subprocess.run([*images.PODMAN, "rm", "-f", name], capture_output=True)
    return tag


def test_preflight_judges_the_image_and_the_runtime(cluster, image, older_image, project, tmp_path):
    env = cluster.env()
    inv = cluster.inventory(count=2, container={"image": image, "runtime": "podman", "options": OPTIONS},
                            node_overrides={1: {"container": {"image": older_image}}})
    result = run_nodectl(["--json", "-i", str(inv), "preflight", "--quick"], env=env, cwd=project, timeout=300)
    assert result.exit_code == 1, result.output
    report = result.json()
    by_check = {(r["check"], r["node"]): r for r in report["results"]}
    assert by_check[("same torch", "cluster")]["verdict"] == "fail"
    assert "2.12.1+cpu" in by_check[("same torch", "cluster")]["detail"]   # the image's torch, not the host's
    assert by_check[("container", "node0")]["verdict"] == "pass"
    assert "podman 4" in by_check[("container", "node0")]["detail"]

    dump = run_nodectl(["--json", "-i", str(inv), "env-dump"], env=env, cwd=project, timeout=300)
    assert dump.exit_code == 0, dump.output
    node1 = dump.json()["nodes"]["node1"]
    assert node1["torch"]["version"] == "2.12.1+cpu" and node1["python"]["executable"] == "/usr/bin/python3"
    assert node1["host"]["python"]["executable"].startswith("/opt/venv")   # the host's own, kept beside it
    assert node1["container"]["image"] == older_image and node1["container"]["image_id"]
    table = run_nodectl(["-i", str(inv), "env-dump"], env={**env, "COLUMNS": "300"}, cwd=project, timeout=300)
    assert "podman: " + older_image in table.stdout and "2.12.1+cpu" in table.stdout

    broken = cluster.inventory(path=tmp_path / "broken.yaml", count=2,
                               container={"image": "localhost/nodectl-no-such-image:1", "runtime": "podman",
                                          "options": OPTIONS},
                               node_overrides={1: {"container": {"image": image, "runtime": "docker"}}})
    result = run_nodectl(["--json", "-i", str(broken), "preflight", "--quick"], env=env, cwd=project, timeout=300)
    assert result.exit_code == 1, result.output
    checks = {(r["check"], r["node"]): r for r in result.json()["results"]}
    assert checks[("container", "node0")]["verdict"] == "fail"
    assert "not on the node and could not be pulled" in checks[("container", "node0")]["detail"]
    assert checks[("container", "node1")]["verdict"] == "fail"   # a docker client with no daemon behind it
    assert "docker" in checks[("container", "node1")]["detail"]


def test_the_built_in_trainer_runs_inside_the_image(cluster, image, project):
    """The built-in FSDP+LoRA trainer (the demo recipe, a few steps) on 2 nodes inside the image: heartbeats,
    status and the adapter on each node as without a container."""
    env = cluster.env()
    inv = str(cluster.inventory(path=project / "trainer.yaml", count=2, env={"NODECTL_DEMO_CACHE": "/tmp/demo"},
                                container={"image": image, "runtime": "podman", "options": OPTIONS}))
    result = run_nodectl(["-i", inv, "launch", "--skip-preflight", "--gpus", "1", "--set", "train.steps=6",
                          "--set", "train.log_every=2"], env=env, cwd=project, timeout=600)
    run_id = latest_run_id(project)
    try:
        assert result.exit_code == 0, result.output
        assert "step 6" in result.stdout or "step=6" in result.stdout, result.stdout[-2000:]
        status = run_nodectl(["--json", "status"], env=env, cwd=project).json()
        assert [row["step"] for row in status["ranks"]] == [6, 6], status
        adapter = cluster.nodes[0].workdir / "runs" / run_id / "output" / "adapter"
        assert (adapter / "adapter_model.safetensors").is_file()
        assert containers_of(run_id) == []
    finally:
        kill_leftovers(run_id)


def test_the_default_preflight_runs_its_all_reduce_inside_the_image(cluster, image, project):
    """preflight's collective job goes through the launch path, so with container: it runs in the image too, and
    leaves no container behind."""
    env = cluster.env()
    inv = str(cluster.inventory(path=project / "same.yaml", count=2, gpus=2,
                                container={"image": image, "runtime": "podman", "options": OPTIONS}))
    result = run_nodectl(["--json", "-i", inv, "preflight"], env=env, cwd=project, timeout=300)
    assert result.exit_code == 0, result.output
    report = result.json()
    rows = {(r["check"], r["node"]): r for r in report["results"]}
    assert rows[("collective", "cluster")]["verdict"] == "pass", rows[("collective", "cluster")]
    assert rows[("same torch", "cluster")]["detail"] == "2.13.0+cpu"
    collective = report["collective"]   # two ranks on each node, all four in one gloo all-reduce
    assert collective["world"] == 4 and collective["backend"] == "gloo", collective
    assert all(size["ok"] for size in collective["sizes"]) and collective["sizes"][-1]["busbw_gbs"] > 0
    script = (project / "runs" / report["collective_run"] / "scripts" / "node1.sh").read_text()
    assert 'podman run --rm --name "$CONTAINER"' in script and image in script   # the job ran in the image
    assert containers_of(report["collective_run"]) == []


ATTACKER = '''\
import json, os, time
run = os.environ["NODECTL_RUN_DIR"]
said = []
def attempt(what, action):
    try:
        action()
        said.append(f"{what} done")
    except OSError as exc:
        said.append(f"{what} refused: {exc.strerror}")
def rewrite_record():   # the record `stop` acts on: rewritten to name another container
    with open(os.path.join(run, "node.json"), "w") as handle:
        handle.write(json.dumps({"container": {"runtime": "podman", "name": "victim"}}))
attempt("node.json", rewrite_record)
attempt("lib", lambda: open(os.path.join(run, "lib", "rankexec.py"), "a").write("# changed\\n"))
said.append(f"state holds {sorted(os.listdir(os.path.join(run, 'state')))}")
# the host-side exit record, aimed at a host file through a link (root on the node writes it)
attempt("state link", lambda: os.symlink(os.environ["VICTIM_FILE"], os.path.join(run, "state", "launcher.exit")))
for folder in ("state", "logs", "output"):   # a folder the host acts on, swapped for a link to another's folder
    attempt(f"{folder} swap", lambda: os.rename(os.path.join(run, folder), os.path.join(run, folder + ".old")))
attempt("new folder", lambda: os.symlink(os.environ["VICTIM_DIR"], os.path.join(run, "planted")))
print("; ".join(said), flush=True)
time.sleep(3)   # streamed before its own log is swapped for a link to the victim's private file
os.unlink(os.path.join(run, "logs", "rank0.log"))
os.symlink(os.environ["VICTIM_DIR"] + "/private.txt", os.path.join(run, "logs", "rank0.log"))
'''


def test_a_rank_in_the_container_cannot_steer_what_the_host_does(cluster, image, project):
    """Root inside the container (podman, rootful) writes only its own folders: the run folder is read-only
    there (node.json, lib/, the scripts), its state/ is an empty read-only folder, the folders it writes cannot be
    swapped for links (they are mounts), and a link it plants inside one (its log, to another user's 0600 file) is
    never read by tail or collect, nor written by the resumed attempt."""
    victim_host = cluster.nodes[0].root / "victim.txt"
    victim_host.write_text("the host's own file\n")
    victim_dir = cluster.nodes[0].root / "victim-dir"
    victim_dir.mkdir(mode=0o700, exist_ok=True)
    (victim_dir / "private.txt").write_text("alice's private line\n")
    (project / "attack.py").write_text(ATTACKER)
    env = cluster.env()
    hosts = cluster.inventory(count=1, container={"image": image, "runtime": "podman", "options": OPTIONS},
                              env={"VICTIM_FILE": "/srv/node/victim.txt", "VICTIM_DIR": "/srv/node/victim-dir"})
    result = run_nodectl(["-i", str(hosts), "launch", "--skip-preflight", "--", "attack.py"], env=env, cwd=project)
    run_id = latest_run_id(project)
    try:
        assert result.exit_code == 0, result.output
        said = result.stdout
        assert "node.json refused: Read-only file system" in said, said
        assert "lib refused: Read-only file system" in said and "state holds []" in said
        assert "state link refused: Read-only file system" in said
        for folder in ("state", "logs", "output"):
            assert f"{folder} swap refused" in said, said
        assert "new folder refused: Read-only file system" in said
        assert victim_host.read_text() == "the host's own file\n", "the exit record went through the link"
        run_dir = cluster.nodes[0].workdir / "runs" / run_id
        assert json.loads((run_dir / "state" / "launcher.exit").read_text())["code"] == 0
        assert json.loads((run_dir / "node.json").read_text())["run_id"] == run_id
        status = run_nodectl(["status", "--run", run_id], env=env, cwd=project)
        assert "exited(0)" in status.stdout, status.output
        for command in (["tail", "rank0", "--run", run_id], ["collect", run_id]):
            shown = run_nodectl(["-i", str(hosts), *command], env=env, cwd=project)
            assert "alice's private line" not in shown.output, (command, shown.output)
        collected = project / "runs" / run_id / "nodes"
        assert not any("alice's private line" in p.read_text(errors="replace")
                       for p in collected.rglob("*") if p.is_file()), "collect read through the link"
        resumed = run_nodectl(["-i", str(hosts), "launch", "--resume", run_id, "--skip-preflight"], env=env,
                              cwd=project)
        assert resumed.exit_code == 0, resumed.output
        assert sorted(p.name for p in victim_dir.iterdir()) == ["private.txt"], "the resumed attempt wrote there"
        assert (victim_dir / "private.txt").read_text() == "alice's private line\n"
    finally:
        kill_leftovers(run_id)
