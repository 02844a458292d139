"""The seed's workflow with a bucket (outputs:): train on two isolated SSH nodes that upload their outputs to a
real S3 server (moto's, with signatures checked) while the run goes, lose those nodes, resume on two fresh ones
that never saw the run, and collect from the bucket. No node shares a disk with the controller or another node;
the bucket is the only way a checkpoint gets from one to the other."""
from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import yaml

from support.cli import run_nodectl

from support.sshcluster import running_cluster
from support.launch import latest_run_id, wait_for
from support.s3server import moto_available, s3_server

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not moto_available(), reason="needs boto3 and moto[server] (the test extra)")]

BUCKET = "team-ckpts"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("s3") / "moto.log") as server:
        server.bucket(BUCKET)
        yield server


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory, 5, first_octet=190) as cluster:
        yield cluster


def write_inventory(cluster, store, path, indices=(0, 1), secret=None, endpoint=None, every="2s"):
    """hosts.yaml for cluster nodes `indices`, named node0, node1, ... whatever machine they are; the store's
    credentials in env: (the inventory's secrets)."""
    document = yaml.safe_load(cluster.inventory(path, indices=list(indices)).read_text())
    for name, entry in enumerate(document["nodes"]):
        entry["name"] = f"node{name}"
    document["defaults"]["env"] = {**store.env, **({"AWS_SECRET_ACCESS_KEY": secret} if secret else {})}
    document["defaults"]["outputs"] = {"url": f"s3://{BUCKET}/team/exp1", "every": every,   # SPEC's form
                                       "endpoint_url": endpoint or store.endpoint}
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def no_secret_anywhere(store, project, *outputs):
    for text in outputs:
        assert store.secret not in text
    for path in (project / "runs").rglob("*"):
        if path.is_file():
            assert store.secret.encode() not in path.read_bytes(), f"{path} holds the secret"


def test_train_upload_lose_the_nodes_resume_elsewhere_collect_from_the_bucket(cluster, store, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    hosts = write_inventory(cluster, store, tmp_path / "hosts.yaml")
    env = cluster.env(NODECTL_INVENTORY=str(hosts))
    trained = run_nodectl(["launch", "--set", "train.steps=30", "--set", "train.checkpoint_every=10"], env=env,
                          cwd=project, timeout=300)
    assert trained.exit_code == 0, trained.output
    assert "outputs: wrote and deleted a probe object" not in trained.output   # the quick preflight's pass is quiet
    run_id = latest_run_id(project)
    assert f"each node uploads to s3://{BUCKET}/team/exp1/{run_id}/<node>/" in trained.output
    prefix = f"team/exp1/{run_id}"
    stored = store.objects(BUCKET, prefix)
    for node, rank in (("node0", 0), ("node1", 1)):
        assert f"{prefix}/{node}/output/checkpoints/ckpt-0000030/COMPLETE" in stored
        assert f"{prefix}/{node}/output/checkpoints/ckpt-0000030/rank{rank}.pt" in stored
        assert f"{prefix}/{node}/logs/rank{rank}.log" in stored
        index = json.loads(store.client().get_object(Bucket=BUCKET, Key=f"{prefix}/{node}/nodectl-index.json")
                           ["Body"].read())
        assert all(stored[f"{prefix}/{node}/{rel}"] == facts["size"] for rel, facts in index["files"].items())
    # keep_checkpoints (2): the run pruned ckpt-10, and so did the bucket
    assert not any("ckpt-0000010" in key for key in stored)

    status = run_nodectl(["status", "--run", run_id], env=env, cwd=project)
    assert f"outputs: s3://{BUCKET}/team/exp1/{run_id}/" in status.stdout
    assert "node0: last upload" in status.stdout and "(the final one)" in status.stdout, status.stdout
    listing = run_nodectl(["runs"], env=env, cwd=project)
    assert f"outputs: s3://{BUCKET}/team/exp1/{run_id}/" in listing.stdout

    # the nodes are returned: their sshd is gone, and their disks with them
    cluster.stop_node(0)
    cluster.stop_node(1)
    fresh = write_inventory(cluster, store, tmp_path / "fresh.yaml", indices=(2, 3))
    env = cluster.env(NODECTL_INVENTORY=str(fresh))
    for index in (2, 3):
        assert not (cluster.nodes[index].workdir / "runs").exists()
    resumed = run_nodectl(["launch", "--resume", run_id, "--set", "train.steps=50"], env=env, cwd=project,
                          timeout=300)
    assert resumed.exit_code == 0, resumed.output
    assert "resuming at step 30" in resumed.output and "completed 50 steps" in resumed.output, resumed.output
    for index in (2, 3):
        assert (cluster.nodes[index].workdir / "runs" / run_id / "output" / "checkpoints" / "ckpt-0000050" /
                "COMPLETE").is_file()
    assert f"{prefix}/node1/output/checkpoints/ckpt-0000050/rank1.pt" in store.objects(BUCKET, prefix)

    collected = run_nodectl(["collect", "--from-store", run_id], env=env, cwd=project)   # SPEC's form
    assert collected.exit_code == 0, collected.output
    home = project / "runs" / run_id / "nodes"
    assert (home / "node1" / "output" / "checkpoints" / "ckpt-0000050" / "rank1.pt").is_file()
    assert "completed 50 steps" in (home / "node0" / "logs" / "rank0.log").read_text()
    no_secret_anywhere(store, project, trained.output, resumed.output, status.output, collected.output)


SCRIPT = '''\
import hashlib, os, sys, time
out, rank = os.environ["NODECTL_OUTPUT_DIR"], int(os.environ["RANK"])
ckpt = os.path.join(out, "checkpoint-1")
if os.environ["NODECTL_ATTEMPT"] == "0":
    if rank == 0:   # as Hugging Face's Trainer does: the weights on global rank 0 only
        os.makedirs(ckpt + ".tmp")
        with open(os.path.join(ckpt + ".tmp", "weights.bin"), "wb") as handle:
            handle.write(os.urandom(3 << 20))
        os.rename(ckpt + ".tmp", ckpt)
    print("checkpoint-1 written", flush=True)
    time.sleep(120)   # stopped by the test
else:
    digest = hashlib.sha256(open(os.path.join(ckpt, "weights.bin"), "rb").read()).hexdigest()
    print(f"rank {rank} resumes from checkpoint-1 {digest}", flush=True)
'''


def test_a_script_uploads_while_running_and_a_fresh_node_gets_rank0s_checkpoint(cluster, store, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text(SCRIPT)
    hosts = write_inventory(cluster, store, tmp_path / "hosts.yaml", indices=(2, 3))
    env = cluster.env(NODECTL_INVENTORY=str(hosts))
    started = run_nodectl(["launch", "--skip-preflight", "--detach", "--", "train.py"], env=env, cwd=project)
    assert started.exit_code == 0, started.output
    run_id = latest_run_id(project)
    key = f"team/exp1/{run_id}/node0/output/checkpoint-1/weights.bin"
    wait_for(lambda: key in store.objects(BUCKET, f"team/exp1/{run_id}"), timeout=60)
    status = run_nodectl(["status", "--run", run_id], env=env, cwd=project)
    assert "running" in status.stdout, "the upload came while the run went on"
    stopped = run_nodectl(["stop", "--run", run_id], env=env, cwd=project)
    assert stopped.exit_code == 0, stopped.output

    # node0 is now a machine that never saw the run; node1 another whose disk was wiped (it had node0's)
    for index in (2, 3):
        shutil.rmtree(cluster.nodes[index].workdir / "runs" / run_id)
    swapped = write_inventory(cluster, store, tmp_path / "swapped.yaml", indices=(4, 2))
    env = cluster.env(NODECTL_INVENTORY=str(swapped))
    resumed = run_nodectl(["launch", "--resume", run_id, "--skip-preflight", "--follow", "all"], env=env, cwd=project,
                          timeout=300)
    assert resumed.exit_code == 0, resumed.output
    digests = {line.split()[-1] for line in resumed.stdout.splitlines() if "resumes from checkpoint-1" in line}
    assert len(digests) == 1 and resumed.stdout.count("resumes from checkpoint-1") == 2, resumed.stdout
    # node0's checkpoint, which node1 took from node0's place for the resume, is node0's: not uploaded again
    stored = store.objects(BUCKET, f"team/exp1/{run_id}")
    assert key in stored and f"team/exp1/{run_id}/node1/output/checkpoint-1/weights.bin" not in stored, sorted(stored)


def test_bad_credentials_fail_preflight_an_unreachable_store_does_not_stop_the_run(cluster, store, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("import os\nopen(os.path.join(os.environ['NODECTL_OUTPUT_DIR'], 'x.txt'),"
                                      " 'w').write('x')\nprint('trained', flush=True)\n")
    wrong = "wrong-secret-0123456789abcdef"
    hosts = write_inventory(cluster, store, tmp_path / "bad.yaml", indices=(2, 3), secret=wrong)
    env = cluster.env(NODECTL_INVENTORY=str(hosts))
    refused = run_nodectl(["launch", "--", "train.py"], env=env, cwd=project)
    assert refused.exit_code == 1, refused.output
    assert "outputs" in refused.stderr and "refused the credentials" in refused.stderr, refused.stderr
    assert "nothing was started" in refused.stderr
    assert wrong not in refused.output, refused.output
    assert not list((project / "runs").glob("2*")), "no run was recorded"

    closed = write_inventory(cluster, store, tmp_path / "closed.yaml", indices=(2, 3),
                             endpoint="http://127.0.0.1:9")
    env = cluster.env(NODECTL_INVENTORY=str(closed))
    ran = run_nodectl(["launch", "--skip-preflight", "--", "train.py"], env=env, cwd=project, timeout=300)
    assert ran.exit_code == 0 and "trained" in ran.stdout, ran.output
    run_id = latest_run_id(project)
    status = run_nodectl(["status", "--run", run_id], env=env, cwd=project)
    assert "upload error" in status.stdout and "cannot be reached" in status.stdout, status.stdout
    no_secret_anywhere(store, project, refused.output, ran.output, status.output)


BIG = '''\
import os, time
out = os.environ["NODECTL_OUTPUT_DIR"]
if int(os.environ["RANK"]) == 0:
    os.makedirs(os.path.join(out, "ckpt-1"))
    with open(os.path.join(out, "ckpt-1", "model.bin"), "wb") as handle:
        block = os.urandom(1 << 20)
        for _ in range(400):
            handle.write(block)
print("written", flush=True)
time.sleep(120)   # stopped by the test
'''


def test_an_uploader_killed_mid_file_leaves_the_run_going_says_so_and_vouches_for_nothing(cluster, store, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text(BIG)
    hosts = write_inventory(cluster, store, tmp_path / "hosts.yaml", indices=(2, 3), every="1s")
    env = cluster.env(NODECTL_INVENTORY=str(hosts))
    started = run_nodectl(["launch", "--skip-preflight", "--detach", "--", "train.py"], env=env, cwd=project)
    assert started.exit_code == 0, started.output
    run_id = latest_run_id(project)
    client, prefix = store.client(), f"team/exp1/{run_id}/node0/"
    wait_for(lambda: client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads"), timeout=90,
             interval=0.05)
    state = cluster.nodes[2].workdir / "runs" / run_id / "state" / "upload.json"
    os.kill(json.loads(state.read_text())["pid"], signal.SIGKILL)   # the node's OOM killer, say

    status = run_nodectl(["status", "--run", run_id], env=env, cwd=project)
    assert status.stdout.count("running") >= 2, status.stdout
    assert "node0" in status.stdout and "ended before its last round (killed?)" in status.stdout, status.stdout
    index = json.loads(client.get_object(Bucket=BUCKET, Key=prefix + "nodectl-index.json")["Body"].read())["files"] \
        if prefix + "nodectl-index.json" in store.objects(BUCKET, prefix) else {}
    assert "output/ckpt-1/model.bin" not in index, "a file half sent is never vouched for"
    stopped = run_nodectl(["stop", "--run", run_id], env=env, cwd=project)
    assert stopped.exit_code == 0, stopped.output


WRITER = '''\
import os
out = os.environ["NODECTL_OUTPUT_DIR"]
if os.environ["NODECTL_ATTEMPT"] == "0":
    with open(os.path.join(out, f"ckpt-100-rank{os.environ['RANK']}.pt"), "wb") as handle:
        handle.write(os.urandom(1 << 20))
    print("ckpt-100 written", flush=True)
else:
    print("resumed", flush=True)
'''


def test_a_resume_whose_pull_fails_keeps_every_earlier_file_and_names_what_it_could_not_bring(cluster, store,
                                                                                                tmp_path):
    """A file node1 lost, whose object in the bucket no longer has its index's size: the resume stops before it
    starts, naming the file, and each node's run folder (attempt 0's checkpoints and logs) is left byte for byte.
    It removed the whole folder on both nodes before."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text(WRITER)
    hosts = write_inventory(cluster, store, tmp_path / "hosts.yaml", indices=(2, 3))
    env = cluster.env(NODECTL_INVENTORY=str(hosts))
    first = run_nodectl(["launch", "--skip-preflight", "--", "train.py"], env=env, cwd=project, timeout=300)
    assert first.exit_code == 0, first.output
    run_id = latest_run_id(project)
    folders = [cluster.nodes[i].workdir / "runs" / run_id for i in (2, 3)]
    before = {path: path.read_bytes() for folder in folders for path in folder.rglob("*")
              if path.is_file() and path.parent.name in ("output", "logs")}
    assert sum(path.name.startswith("ckpt-100") for path in before) == 2, sorted(before)
    key = f"team/exp1/{run_id}/node1/output/ckpt-100-rank1.pt"
    wait_for(lambda: key in store.objects(BUCKET, f"team/exp1/{run_id}"))
    store.client().put_object(Bucket=BUCKET, Key=key, Body=b"short")   # no longer what the index says
    lost = folders[1] / "output" / "ckpt-100-rank1.pt"   # and node1 lost its copy: the resume must fetch it
    lost.unlink()
    before.pop(lost)
    resumed = run_nodectl(["launch", "--resume", run_id, "--skip-preflight"], env=env, cwd=project, timeout=300)
    assert resumed.exit_code != 0 and "resumed" not in resumed.stdout, resumed.output
    assert "output/ckpt-100-rank1.pt: the store holds 5 bytes, its index 1048576" in resumed.output, resumed.output
    assert "every file already in its run folder is kept" in resumed.output
    cause = next(line for line in resumed.output.splitlines() if "could not take the run's outputs" in line)
    assert "node1 could not take the run's outputs from the store: 1 file(s)" in cause, cause   # node1 named once
    for path, data in before.items():   # attempt 0's logs were archived under attempts/0/ by the resume
        kept = path if path.parent.name == "output" else path.parents[1] / "attempts" / "0" / "logs" / path.name
        assert kept.is_file() and kept.read_bytes() == data, f"{kept} changed or went"

    # a name this machine's file system refuses, listed in node0's index: one entry not brought, not an abort
    client, index_key = store.client(), f"team/exp1/{run_id}/node0/nodectl-index.json"
    index = json.loads(client.get_object(Bucket=BUCKET, Key=index_key)["Body"].read())
    odd = "output/" + "x" * 300
    index["files"][odd] = {"size": 4, "mtime_ns": 1}
    client.put_object(Bucket=BUCKET, Key=f"team/exp1/{run_id}/node0/{odd}", Body=b"long")
    client.put_object(Bucket=BUCKET, Key=index_key, Body=json.dumps(index).encode())
    collected = run_nodectl(["collect", "--from-store", run_id], env=env, cwd=project)
    assert collected.exit_code == 1 and "Traceback" not in collected.stderr, collected.output
    assert "node0: not brought: output/xxxx" in collected.stderr and "File name too long" in collected.stderr
    home = project / "runs" / run_id / "nodes"
    assert (home / "node0" / "output" / "ckpt-100-rank0.pt").is_file()   # the node's other files came home
    assert "node1: not brought: output/ckpt-100-rank1.pt (the store holds 5 bytes, its index 1048576)" in \
        collected.stderr and (home / "node1" / "logs").is_dir()
