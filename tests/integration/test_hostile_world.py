"""Issue 29 on real processes: a local node with the real runctl, nodectl run as a user runs it."""
from __future__ import annotations

import json
import marshal
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

from nodectl.inventory import parse_inventory
from nodectl.remote import agent
from nodectl.transport import Cluster, TransportOptions
from support import REPO
from support.cli import CLIResult, nodectl_in

SCRIPT = """\
import json
import os
out = os.path.join(os.environ["NODECTL_RUN_DIR"], "output")
os.makedirs(out, exist_ok=True)
os.mkfifo(os.path.join(out, "pipe"))
os.symlink("/etc/passwd", os.path.join(out, "passwd"))
open(os.path.join(out, "result.txt"), "w").write("ok")
print("done", flush=True)
"""


def nodectl(folder: Path, *args: str) -> CLIResult:
    """Under a permissive umask: what nodectl keeps private, it makes private itself."""
    return nodectl_in(folder, *args, umask=0o022)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_run_records_are_private_and_collect_brings_back_no_script_nor_special_file(tmp_path):
    (tmp_path / "hosts.yaml").write_text(f"nodes:\n  - {{host: localhost, name: n0, transport: local, device: cpu, "
                                         f"gpus: 1, workdir: {tmp_path / 'work'}, env: {{DB_PASS: hunter2}}}}\n")
    (tmp_path / "job.py").write_text(SCRIPT)
    launched = nodectl(tmp_path, "launch", "--skip-preflight", "--", "job.py", "--db-pass", "hunter2")
    assert launched.exit_code == 0, launched.stdout + launched.stderr
    [run] = [p for p in (tmp_path / "runs").iterdir() if not p.name.startswith(".")]
    assert mode(tmp_path / "runs") == 0o700 and mode(run) == 0o700 and mode(tmp_path / "state" / "runs") == 0o700
    for path in [run / "manifest.json", *(run / "scripts").iterdir()]:
        assert mode(path) & 0o077 == 0, path
        assert "hunter2" not in path.read_text(), path
    collected = nodectl(tmp_path, "collect")
    assert collected.exit_code == 0, collected.stdout + collected.stderr
    node = run / "nodes" / "n0"
    assert (node / "output" / "result.txt").read_text() == "ok"
    assert not (node / "launch.sh").exists() and not (node / "env.sh").exists()
    assert not (node / "output" / "pipe").exists() and not (node / "output" / "passwd").exists()
    assert "output/pipe" in collected.stderr and "output/passwd" in collected.stderr
    assert not any("hunter2" in p.read_text(errors="replace") for p in node.rglob("*") if p.is_file())


def test_a_runctl_planted_in_a_shared_workdir_is_never_run(tmp_path):
    """Another user (here: a world-writable folder and foreign bytes) plants runctl-<hash>.pyz where nodectl will
    look; nodectl replaces it and never executes it."""
    workdir = tmp_path / "scratch"
    inventory = parse_inventory(f"nodes:\n  - {{host: localhost, name: n0, transport: local, device: cpu, "
                                f"python: {sys.executable}, workdir: {workdir}}}\n")
    planted = Path(agent.agent_path(str(workdir)))
    planted.parent.mkdir(parents=True)
    planted.parent.chmod(0o777)
    marker = tmp_path / "PWNED"
    planted.write_text(f"open({str(marker)!r}, 'w').write('ran')\nprint('{{}}')\n")
    for attempt in range(3):   # a fresh connection each time: the first call bootstraps, later ones run the file
        with Cluster(inventory.nodes, TransportOptions()) as cluster:
            [first, second] = [cluster.fan_out(lambda t: agent.call(t, "port", "0"))[0] for _ in range(2)]
        assert first.ok and second.ok and second.value.port > 0, (first, second)
    assert not marker.exists()
    assert planted.read_bytes() == agent._runctl()[0] and mode(planted.parent) == 0o700


def test_runctls_code_is_compiled_once_per_node_and_only_a_private_copy_of_this_artifact_is_run(tmp_path):
    """runctl's modules are compiled by the node's first call and kept beside the artifact (launchers/codecache.py);
    later calls import from that file. A file there that is not the login user's alone, or was compiled from other
    bytes, is never run: it is compiled again from the artifact."""
    from nodectl.resources.launchers import codecache

    workdir = tmp_path / "work"
    inventory = parse_inventory(f"nodes:\n  - {{host: localhost, name: n0, transport: local, device: cpu, "
                                f"python: {sys.executable}, workdir: {workdir}}}\n")
    artifact = Path(agent.agent_path(str(workdir)))

    def port_twice() -> None:   # the first call of a connection bootstraps, the second runs the installed file
        with Cluster(inventory.nodes, TransportOptions()) as cluster:
            for _ in range(2):
                [answer] = cluster.fan_out(lambda t: agent.call(t, "port", "0"))
                assert answer.ok and answer.value.port > 0, answer

    port_twice()
    [kept] = artifact.parent.glob(artifact.name + ".*.codes")
    assert mode(kept) == 0o600 and kept.read_bytes().startswith(codecache._header(artifact.read_bytes()))
    written = kept.stat().st_mtime_ns
    port_twice()
    assert kept.stat().st_mtime_ns == written   # read, not compiled again

    # a kept file whose runctl.net says it ran: used as it is while it is private and names this artifact's bytes
    marker = tmp_path / "RAN-FROM-CACHE"
    data = artifact.read_bytes()
    index, blobs = codecache._compile_all(str(artifact), data)
    net = (REPO / "launchers" / "runctl" / "net.py").read_text()
    planted = marshal.dumps(compile(net + f"\nopen({str(marker)!r}, 'w').close()\n", "net.py", "exec"))
    index["runctl.net"] = (False, len(blobs), len(blobs) + len(planted))
    blobs += planted

    def plant(header: bytes, file_mode: int) -> None:
        kept.write_bytes(header + marshal.dumps(index) + blobs)
        kept.chmod(file_mode)

    plant(codecache._header(data), 0o600)
    port_twice()
    assert marker.exists()   # the mechanism: the kept code is what runs
    for header, file_mode in ((codecache._header(data), 0o620), (codecache._header(data + b"other"), 0o600)):
        marker.unlink(missing_ok=True)
        plant(header, file_mode)
        port_twice()
        assert not marker.exists(), (header[-8:], oct(file_mode))   # not run: compiled again, and kept private
        assert mode(kept) == 0o600 and kept.read_bytes().startswith(codecache._header(data))


ESCAPER = """\
import os, sys, time
# a child that leaves the process group and sheds the environment nodectl marks its processes with
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execve("/bin/sleep", ["sleep", "300"], {})  # 300: its own (test_killed_rank's may run beside it)
    os._exit(0)
time.sleep(1)
print("escaped a child", flush=True)
time.sleep(300)
"""


def test_a_child_that_sheds_the_runs_environment_does_not_survive_stop(tmp_path):
    (tmp_path / "hosts.yaml").write_text(f"nodes:\n  - {{host: localhost, name: n0, transport: local, device: cpu, "
                                         f"gpus: 1, workdir: {tmp_path / 'work'}}}\n")
    (tmp_path / "escape.py").write_text(ESCAPER)
    launched = nodectl(tmp_path, "launch", "--skip-preflight", "--detach", "--", "escape.py")
    assert launched.exit_code == 0, launched.stdout + launched.stderr

    def sleepers() -> list[int]:
        found = []
        for entry in os.listdir("/proc"):
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if cmdline == b"sleep\x00300\x00" and not Path(f"/proc/{entry}/environ").read_bytes():
                found.append(int(entry))
        return found

    deadline = time.time() + 60
    while not sleepers() and time.time() < deadline:
        time.sleep(0.3)
    escaped = sleepers()
    assert escaped, "the escaping child never started"
    try:
        stopped = nodectl(tmp_path, "stop", "--grace", "3")
        assert stopped.exit_code == 0, stopped.stdout + stopped.stderr
        assert "0 left" in stopped.stdout + stopped.stderr
        assert not [pid for pid in escaped if Path(f"/proc/{pid}").exists()
                    and "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]]
    finally:
        for pid in escaped:
            try:
                os.kill(pid, 9)
            except OSError:
                pass


ORPHAN_MAKER = """\
import os, time
# a grandchild in a session of its own with an empty environment; then the launch script itself is killed
# (an OOM kill, a user's kill -9), so the orphan goes to init: out of the run's tree and without its markers
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execve("/bin/sleep", ["sleep", "303"], {})
    os._exit(0)
print("made one", flush=True)
time.sleep(600)
"""


def _root_can_make_a_cgroup() -> bool:
    """Asked independently of runctl: some cgroup hierarchy of this machine takes a new group from root."""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if os.geteuid() == 0 and fields[2] in ("cgroup", "cgroup2") and \
                (fields[2] == "cgroup2" or {"name=systemd", "pids"} & set(fields[3].split(","))):
            probe = Path(fields[1]) / f"nodectl-probe-{os.getpid()}"
            try:
                probe.mkdir()
                probe.rmdir()
                return True
            except OSError:
                continue
    return False


def test_what_escaped_the_tree_and_its_markers_is_still_stopped_through_the_runs_cgroup(ssh_cluster, tmp_path):
    """On a node where nodectl may make a cgroup (node0 logs in as root), the run's processes are in one of
    their own: an orphan that shed the environment and was handed to init when launch.sh was killed is found by
    `stop` all the same, and the group is removed afterwards. Before, nothing could find it: it held on."""
    import pytest

    from support.cli import run_nodectl
    from support.launch import latest_run_id, wait_for

    if not _root_can_make_a_cgroup():
        pytest.skip("no cgroup hierarchy on this machine lets root make a group (a container without them)")
    project = tmp_path / "project"
    project.mkdir()
    (project / "orphan.py").write_text(ORPHAN_MAKER)
    env = ssh_cluster.env()
    inventory = str(ssh_cluster.inventory(tmp_path / "hosts.yaml", count=1))
    launched = run_nodectl(["-i", inventory, "launch", "--skip-preflight", "--detach", "--", "orphan.py"],
                           env=env, cwd=project)
    assert launched.exit_code == 0, launched.output
    run_id = latest_run_id(project)
    state = ssh_cluster.nodes[0].workdir / "runs" / run_id / "state"
    try:
        wait_for(lambda: _sleeping("303"))
        group = json.loads((state / "cgroup").read_text())
        assert Path(group["dir"]).is_dir(), group
        os.kill(int((state / "pgid").read_text()), 9)   # launch.sh: its orphans now go to init
        [orphan] = _sleeping("303")
        assert not Path(f"/proc/{orphan}/environ").read_bytes()
        stopped = run_nodectl(["stop", "--grace", "2"], env=env, cwd=project)
        assert stopped.exit_code == 0, stopped.output
        assert "0 left" in stopped.stderr, stopped.output
        assert _sleeping("303") == []
        assert not Path(group["dir"]).exists()
    finally:
        for pid in _sleeping("303"):
            os.kill(pid, 9)


LINGERER = """\
import os, signal, time
# a child that ignores SIGTERM, sheds the environment and keeps a grandchild of its own in another session,
# both still alive when the rank (and so the run) ends
if os.fork() == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.fork() == 0:
        os.setsid()
        os.execve("/bin/sleep", ["sleep", "302"], {})
    os.execve("/bin/sleep", ["sleep", "301"], {})
time.sleep(1)
print("left two behind", flush=True)
"""


def _sleeping(seconds: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            if Path(f"/proc/{entry}/cmdline").read_bytes() == f"sleep\x00{seconds}\x00".encode() and \
                    "Z" not in Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]:
                found.append(int(entry))
        except OSError:
            continue
    return found


def test_what_a_finished_run_leaves_behind_is_ended_with_its_own_children(tmp_path):
    """The run ends on its own (no `stop`): its launch script ends every process still below it, children of
    escaped children too, and SIGKILLs what ignores SIGTERM; nothing is handed to init to outlive the run."""
    (tmp_path / "hosts.yaml").write_text(f"nodes:\n  - {{host: localhost, name: n0, transport: local, device: cpu, "
                                         f"gpus: 1, workdir: {tmp_path / 'work'}}}\n")
    (tmp_path / "linger.py").write_text(LINGERER)
    try:
        launched = nodectl(tmp_path, "launch", "--skip-preflight", "--", "linger.py")
        assert launched.exit_code == 0, launched.stdout + launched.stderr
        assert "left two behind" in launched.stdout
        deadline = time.time() + 10
        while (_sleeping("301") or _sleeping("302")) and time.time() < deadline:
            time.sleep(0.2)
        assert _sleeping("301") == [] and _sleeping("302") == []
    finally:
        for pid in _sleeping("301") + _sleeping("302"):
            os.kill(pid, 9)


def test_a_node_that_floods_before_its_answer_costs_bounded_memory(ssh_cluster, tmp_path, monkeypatch):
    """A compromised node printed 1 GB before its JSON and drove `status` to 3 GB. What is kept of a command's
    output is bounded (its newest part, where the answer is), and the answer is still read."""
    from nodectl.inventory import load_inventory

    for key, value in ssh_cluster.env().items():
        monkeypatch.setenv(key, value)
    inventory = load_inventory(ssh_cluster.inventory(tmp_path / "one.yaml", count=1))
    with Cluster(inventory.nodes, TransportOptions()) as cluster:
        transport = cluster.transport(inventory.nodes[0])
        result = transport.run("head -c 300000000 /dev/zero | tr '\\0' x; echo; echo '{\"answer\": 42}'",
                               timeout=300)
    assert agent.last_json(result.stdout) == {"answer": 42}
    assert len(result.stdout) <= 33 << 20


def test_a_command_whose_connection_closes_under_it_ends_at_once(ssh_cluster, tmp_path, monkeypatch):
    """A connection closed under a running command (the controller closing its connections while a stop still
    waits on a node, or paramiko finding the link dead) ends that command's wait at once, as a lost connection,
    instead of keeping the caller (and the process's exit) waiting out the command's whole timeout."""
    import threading

    from nodectl.inventory import load_inventory
    from nodectl.transport import Unreachable

    for key, value in ssh_cluster.env().items():
        monkeypatch.setenv(key, value)
    inventory = load_inventory(ssh_cluster.inventory(tmp_path / "one.yaml", count=1))
    outcome = {}

    with Cluster(inventory.nodes, TransportOptions()) as cluster:
        transport = cluster.transport(inventory.nodes[0])

        def wait_on_node():
            try:
                outcome["result"] = transport.run("sleep 60", timeout=120)
            except Exception as exc:
                outcome["error"] = exc

        waiting = threading.Thread(target=wait_on_node)
        waiting.start()
        time.sleep(1.5)
        closed = time.monotonic()
        transport.close()
        waiting.join(timeout=20)
        assert not waiting.is_alive() and time.monotonic() - closed < 10
    assert isinstance(outcome.get("error"), Unreachable), outcome


def test_a_controller_killed_while_starting_leaves_a_settled_run_and_nothing_on_the_nodes(ssh_cluster, tmp_path):
    """kill -9 of `nodectl launch` during the sync: `status` settles the run from the nodes' truth (failed: nodectl
    ended while starting it; no node started it; exit 1, not "lost" with exit 3), and `stop` removes what the
    nodes had prepared."""
    import json
    import signal

    from support.cli import run_nodectl
    from support.launch import latest_run_id

    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('never')\n")
    with open(project / "weights.bin", "wb") as handle:   # sparse: cheap to make, long enough to send
        handle.truncate(480 << 20)
    env = ssh_cluster.env()
    inventory = str(ssh_cluster.inventory(count=2))
    controller = subprocess.Popen([sys.executable, "-m", "nodectl", "-i", inventory, "launch", "--skip-preflight",
                                   "--", "train.py"], cwd=project, env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not list((project / "runs").glob("*/manifest.json")) if (project / "runs").is_dir() else True:
        assert time.time() < deadline and controller.poll() is None
        time.sleep(0.02)
    controller.send_signal(signal.SIGKILL)
    controller.wait()
    run_id = latest_run_id(project)
    assert json.loads((project / "runs" / run_id / "manifest.json").read_text())["state"] == "starting"
    status = run_nodectl(["--json", "status"], env=env, cwd=project)
    assert status.exit_code == 1, status.output
    document = status.json()
    assert document["state"] == "failed"
    assert [row["state"] for row in document["ranks"]] == ["not started", "not started"], document["ranks"]
    manifest = json.loads((project / "runs" / run_id / "manifest.json").read_text())
    assert manifest["failure"]["kind"] == "controller"
    assert "while it was starting the run" in run_nodectl(["status"], env=env, cwd=project).stdout
    stopped = run_nodectl(["stop"], env=env, cwd=project)
    assert stopped.exit_code == 0, stopped.output
    for node in ssh_cluster.nodes[:2]:
        assert not (node.workdir / "runs" / run_id).exists()


def test_a_launch_that_cannot_start_everywhere_leaves_no_prepared_folder_behind(ssh_cluster, tmp_path):
    """node1 cannot be prepared (a file sits where its runs folder goes): the run fails to start, and node0,
    prepared in time, keeps nothing of it (its env.sh holds the run's secrets); before, its folder stayed there,
    never run."""
    from support.cli import run_nodectl
    from support.launch import latest_run_id

    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('never')\n")
    inventory = str(ssh_cluster.inventory(tmp_path / "hosts.yaml", count=2, env={"API_TOKEN": "tok-0c0ffee"},
                                          node_overrides={1: {"workdir": "~/nodectl-blocked"}}))
    ssh_cluster.node_file(1, "nodectl-blocked/runs", "a file where the runs folder goes\n")
    launched = run_nodectl(["-i", inventory, "launch", "--skip-preflight", "--", "train.py"],
                           env=ssh_cluster.env(), cwd=project)
    assert launched.exit_code != 0 and "node1" in launched.stderr, launched.output
    assert "the folders prepared for it removed" in launched.stderr
    run_id = latest_run_id(project)
    assert json.loads((project / "runs" / run_id / "manifest.json").read_text())["state"] == "failed-to-start"
    assert not (ssh_cluster.nodes[0].workdir / "runs" / run_id).exists()


CORRUPT_MANIFESTS = ['garbage{', '[1, 2]', '{"run_id": 5, "state": []}', '{"state": "running", "plan": 7}', '\x00\xff\xfe',
                     '{"run_id": "x", "state": "nonsense", "plan": {"nodes": "n"}}', '']


def test_damaged_run_records_are_named_and_never_hide_the_others(tmp_path):
    """The audit broke 26 of 35 manifests into tracebacks, and one bad manifest broke `nodectl runs` for every
    run. Each damaged record is now one row saying so; asking for it is exit 2 naming the file."""
    (tmp_path / "hosts.yaml").write_text(f"nodes:\n  - {{host: localhost, name: n0, transport: local, device: cpu, "
                                         f"gpus: 1, workdir: {tmp_path / 'work'}}}\n")
    (tmp_path / "ok.py").write_text("print('fine', flush=True)\n")
    launched = nodectl(tmp_path, "launch", "--skip-preflight", "--", "ok.py")
    assert launched.exit_code == 0, launched.stdout + launched.stderr
    good = json.loads(nodectl(tmp_path, "--json", "runs").stdout)["runs"][0]["run_id"]
    damaged = []
    for i, text in enumerate(CORRUPT_MANIFESTS):
        folder = tmp_path / "runs" / f"20200101-00000{i}-dead"
        folder.mkdir(parents=True)
        (folder / "manifest.json").write_bytes(text.encode("latin-1"))
        # the user's own records, damaged: registered as nodectl registers every run it records
        (tmp_path / "state" / "runs" / f"{folder.name}.json").write_text(json.dumps({"folder": str(folder)}))
        damaged.append(folder.name)
    listed = nodectl(tmp_path, "--json", "runs")
    assert listed.exit_code == 0, listed.stderr
    states = {row["run_id"]: row["state"] for row in json.loads(listed.stdout)["runs"]}
    assert states[good] == "succeeded" and all(states[name] == "unreadable" for name in damaged)
    for name in damaged:
        for command in (["status", "--run", name], ["tail", "rank0", "--run", name], ["stop", "--run", name]):
            result = nodectl(tmp_path, *command)
            assert result.exit_code == 2, (command, text, result.stderr)
            assert "manifest unreadable" in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_a_run_record_shipped_in_a_cloned_project_is_never_used(tmp_path):
    """A project folder that comes with runs/<id>/manifest.json (cloned, unpacked, another user's): its python:,
    node names and folders would be acted on as the user's own. nodectl reads only the runs it recorded for this
    user (its registry in the user's state folder), says which records it ignores, and acts on none of them."""
    (tmp_path / "hosts.yaml").write_text(f"nodes:\n  - {{host: localhost, name: n0, transport: local, device: cpu, "
                                         f"gpus: 1, workdir: {tmp_path / 'work'}}}\n")
    (tmp_path / "ok.py").write_text("print('fine', flush=True)\n")
    assert nodectl(tmp_path, "launch", "--skip-preflight", "--", "ok.py").exit_code == 0
    mine = json.loads(nodectl(tmp_path, "--json", "runs").stdout)["runs"][0]["run_id"]
    canary = tmp_path / "pwned"
    victim = tmp_path / "victim"
    victim.mkdir()
    shipped = tmp_path / "runs" / "20990101-000000-evil"
    shipped.mkdir()
    node = {"name": "../../..", "host": "localhost", "addr": "127.0.0.1", "index": 0, "transport": "local",
            "device": "cpu", "python": f"/bin/sh -c 'touch {canary}' #", "workdir": str(victim), "env": {}}
    (shipped / "manifest.json").write_text(json.dumps({
        "run_id": shipped.name, "state": "starting", "failure": {"kind": "controller"},
        "plan": {"run_id": shipped.name, "command": ["x.py"], "nodes": [
            {"node": node, "node_rank": 0, "nproc": 1, "ranks": [0], "run_dir": str(victim), "env": {}}]}}))
    listed = nodectl(tmp_path, "--json", "runs")
    assert [row["run_id"] for row in json.loads(listed.stdout)["runs"]] == [mine]
    assert "ignored 1 run record(s)" in listed.stderr and shipped.name in listed.stderr
    for command in (["status", "--run", shipped.name], ["stop", "--run", shipped.name],
                    ["collect", "--run", shipped.name], ["launch", "--resume", shipped.name]):
        refused = nodectl(tmp_path, *command)
        assert refused.exit_code == 2 and "not written by nodectl for this user" in refused.stderr, refused.stderr
    bare = nodectl(tmp_path, "stop")   # the latest run is the user's own, never the shipped one
    assert bare.exit_code == 0 and f"stopping run {mine}" in bare.stderr, bare.stderr
    assert victim.is_dir() and not canary.exists()


def test_a_users_own_record_edited_to_name_etc_or_a_climbing_node_is_refused_by_every_reader(tmp_path):
    """Write access to one's own run record made `launch --resume` sync the controller's /etc (shadow included)
    to the nodes (`sync_dir: /etc`), and `collect --from-store` write outside runs/<id>/nodes/ (a node named
    ../../..): every reader now takes a record only through the plan's typed reading, and a resume syncs only the
    project the run was launched from."""
    (tmp_path / "hosts.yaml").write_text(f"nodes:\n  - {{host: localhost, name: n0, transport: local, device: cpu, "
                                         f"gpus: 1, workdir: {tmp_path / 'work'}}}\n")
    (tmp_path / "ok.py").write_text("print('fine', flush=True)\n")
    assert nodectl(tmp_path, "launch", "--skip-preflight", "--", "ok.py").exit_code == 0
    run_id = json.loads(nodectl(tmp_path, "--json", "runs").stdout)["runs"][0]["run_id"]
    record = tmp_path / "runs" / run_id / "manifest.json"
    original = json.loads(record.read_text())

    edited = json.loads(json.dumps(original))
    edited["plan"]["sync_dir"] = "/etc"
    record.write_text(json.dumps(edited))
    resumed = nodectl(tmp_path, "launch", "--resume", run_id, "--skip-preflight")
    assert resumed.exit_code == 2 and "plan.sync_dir '/etc' is not the project" in resumed.stderr, resumed.stderr
    assert not list((tmp_path / "work").rglob("shadow")), "nothing of /etc reached the node"

    edited = json.loads(json.dumps(original))
    edited["plan"]["nodes"][0]["node"]["name"] = "../../.."
    edited["plan"]["outputs"] = {"url": "s3://bucket/prefix"}
    record.write_text(json.dumps(edited))
    for command in (["collect", "--from-store", run_id], ["status", "--run", run_id], ["tail", "rank0", "--run", run_id]):
        refused = nodectl(tmp_path, *command)
        assert refused.exit_code == 2 and "Traceback" not in refused.stderr, (command, refused.stderr)
        assert f"run {run_id}'s record" in refused.stderr and "name" in refused.stderr, (command, refused.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hosts.yaml", "ok.py", "runs", "state", "work"]
