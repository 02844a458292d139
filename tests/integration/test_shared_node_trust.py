"""A shared node: root logs in and runs under a workdir in a world-writable scratch folder, where a second,
unprivileged user (nodectl-mallory, a real account on the isolated node) got there first. Every attack of the
audit that started from such a head start is refused before anything is used, with exit 2 and a message that
names the folder, what is wrong with it and the fix; nothing of the other user's is chmod-ed, written or run."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
import yaml

from support import REPO

from support.cli import run_nodectl

from support.sshcluster import running_cluster
from support.sshcluster import ensure_user

pytestmark = pytest.mark.slow
MALLORY = "nodectl-mallory"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory, 1, first_octet=200) as cluster:
        yield cluster


@pytest.fixture
def mallory():
    return ensure_user(MALLORY, "/bin/sh")


def mallorys(user, path) -> None:
    """Make `path` (just created) the other user's, link included, as if that user had made it."""
    os.lchown(path, user.pw_uid, user.pw_gid)


def scratch(cluster, name: str):
    """A /scratch-like folder on the node (root's, mode 1777): (its path as the node sees it, as the host does)."""
    host = cluster.nodes[0].root / name
    host.mkdir()
    os.chmod(host, 0o1777)
    return f"/srv/node/{name}", host


def project_and_env(cluster, tmp_path, workdir: str):
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('the run ran', flush=True)\n")
    hosts = cluster.inventory(tmp_path / "hosts.yaml")
    document = yaml.safe_load(hosts.read_text())
    document["defaults"]["workdir"] = workdir
    hosts.write_text(yaml.safe_dump(document))
    return project, cluster.env(NODECTL_INVENTORY=str(hosts))


@pytest.mark.parametrize("preflight", [True, False])
def test_a_workdir_that_is_another_users_link_is_refused_and_nothing_is_made_where_it_points(cluster, mallory, tmp_path,
                                                                                          preflight):
    """`ln -s /etc /srv/shared/rootwd` by another user in a world-writable sticky folder, then a root launch with
    that workdir: it made /etc/.nodectl and /etc/runs and ran the job there (the target's owner was judged, never
    the link's). Now the path is judged as OpenSSH's StrictModes judges it: the link, its owner and the fix."""
    node_path, host = scratch(cluster, f"scratch-wd-{preflight}")
    victim = cluster.nodes[0].root / f"etc-like-{preflight}"   # a system folder of root's
    victim.mkdir()
    os.chmod(victim, 0o755)
    (host / "rootwd").symlink_to(f"/srv/node/{victim.name}")
    mallorys(mallory, host / "rootwd")
    project, env = project_and_env(cluster, tmp_path, f"{node_path}/rootwd")
    done = run_nodectl(["launch", *([] if preflight else ["--skip-preflight"]), "--", "train.py"], env=env,
                       cwd=project)
    assert done.exit_code == 2, done.output
    assert f"{node_path}/rootwd" in done.stderr and "symbolic link" in done.stderr, done.stderr
    assert f"owned by uid {mallory.pw_uid}" in done.stderr, done.stderr
    assert "mkdir -m 700" in done.stderr or "a folder of your own" in done.stderr, done.stderr   # the fix
    assert "Traceback" not in done.stderr and "the run ran" not in done.stdout
    assert sorted(os.listdir(victim)) == [], "nothing made where the link points"


@pytest.mark.parametrize("preflight", [True, False])
def test_a_planted_nodectl_link_is_refused_and_what_it_points_at_is_untouched(cluster, mallory, tmp_path, preflight):
    node_path, host = scratch(cluster, f"scratch-link-{preflight}")
    victim = cluster.nodes[0].root / f"victim-{preflight}"   # a system folder of root's, readable by all
    victim.mkdir()
    os.chmod(victim, 0o755)
    (victim / "config").write_text("root's\n")
    (host / "work").mkdir()
    os.chmod(host / "work", 0o1777)   # root's shared work folder, sticky: mallory may add, not replace
    (host / "work" / ".nodectl").symlink_to(f"/srv/node/{victim.name}")
    mallorys(mallory, host / "work" / ".nodectl")
    project, env = project_and_env(cluster, tmp_path, f"{node_path}/work")
    done = run_nodectl(["launch", *([] if preflight else ["--skip-preflight"]), "--", "train.py"], env=env,
                       cwd=project)
    assert done.exit_code == 2, done.output
    assert f"{node_path}/work/.nodectl" in done.stderr and "symbolic link" in done.stderr, done.stderr
    assert "workdir:" in done.stderr and "Traceback" not in done.stderr
    assert "the run ran" not in done.stdout
    assert stat.S_IMODE(victim.stat().st_mode) == 0o755, "root never chmod-s what the link points at"
    assert sorted(p.name for p in victim.iterdir()) == ["config"], "nothing is written through the link"


def test_a_runs_folder_another_user_made_first_is_refused(cluster, mallory, tmp_path):
    node_path, host = scratch(cluster, "scratch-runs")
    (host / "work").mkdir()
    os.chmod(host / "work", 0o1777)
    (host / "work" / "runs").mkdir()
    os.chmod(host / "work" / "runs", 0o777)
    mallorys(mallory, host / "work" / "runs")
    project, env = project_and_env(cluster, tmp_path, f"{node_path}/work")
    done = run_nodectl(["launch", "--skip-preflight", "--", "train.py"], env=env, cwd=project)
    assert done.exit_code == 2, done.output
    assert f"{node_path}/work/runs" in done.stderr and MALLORY in done.stderr, done.stderr
    assert not any((host / "work" / "runs").iterdir()), "no run folder was made inside the other user's folder"


def test_a_workdir_another_user_owns_is_refused(cluster, mallory, tmp_path):
    node_path, host = scratch(cluster, "scratch-owned")
    (host / "work").mkdir()
    os.chmod(host / "work", 0o777)
    mallorys(mallory, host / "work")
    project, env = project_and_env(cluster, tmp_path, f"{node_path}/work")
    done = run_nodectl(["launch", "--", "train.py"], env=env, cwd=project)
    assert done.exit_code == 2, done.output
    assert f"{node_path}/work" in done.stderr and "owned by uid" in done.stderr, done.stderr
    assert not (host / "work" / ".nodectl").exists() and not (host / "work" / "runs").exists()


def test_a_sticky_shared_scratch_is_used_and_what_nodectl_keeps_there_is_private(cluster, tmp_path):
    node_path, host = scratch(cluster, "scratch-fine")
    project, env = project_and_env(cluster, tmp_path, f"{node_path}/work")
    done = run_nodectl(["launch", "--", "train.py"], env=env, cwd=project)
    assert done.exit_code == 0 and "the run ran" in done.stdout, done.output
    for folder in (host / "work" / ".nodectl", host / "work" / "runs"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.stat().st_uid == 0


def test_a_crafted_cgroup_record_never_makes_stop_signal_another_process(tmp_path):
    """state/cgroup with an empty path matched every cgroup; only the group runctl makes for the run counts."""
    run_dir = tmp_path / "work" / "runs" / "20260101-000000-abcd"
    for name in ("state", "logs"):
        (run_dir / name).mkdir(parents=True)
    os.chmod(tmp_path / "work", 0o700)
    (run_dir / "node.json").write_text(json.dumps({"run_id": "20260101-000000-abcd", "node_rank": 0, "ranks": [0]}))
    (run_dir / "state" / "pgid").write_text("1")
    (run_dir / "state" / "cgroup").write_text(json.dumps({"dir": "/sys/fs/cgroup", "key": "", "path": ""}))
    victim = subprocess.Popen(["sleep", "60"])
    try:
        answer = subprocess.run([sys.executable, "-m", "runctl", "stop", str(run_dir)], cwd=REPO / "launchers",
                                input='{"grace": 1}', capture_output=True, text=True, timeout=60)
        reply = json.loads(answer.stdout.strip().splitlines()[-1])
        assert reply.get("terminated") == 0 and reply.get("left") == 0, reply
        assert victim.poll() is None, "a process outside the run was signalled"
    finally:
        victim.kill()
