"""The node's uploader (launchers/nodectl_outputs.py) against a real S3 server: what reaches the bucket is what a
file was, or nothing; what a pull takes back is only what the node's index vouches for."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from support import REPO
from support.launch import wait_for
from support.s3server import moto_available, s3_server

pytestmark = pytest.mark.skipif(not moto_available(), reason="needs boto3 and moto[server] (the test extra)")

BUCKET = "node-side"
UPLOADER = REPO / "launchers" / "nodectl_outputs.py"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("s3") / "moto.log") as server:
        server.bucket(BUCKET)
        yield server


@pytest.fixture
def module(store, monkeypatch):
    for name, value in store.env.items():
        monkeypatch.setenv(name, value)
    import importlib.util

    monkeypatch.syspath_prepend(str(UPLOADER.parent))   # runlayout and nodeio beside it, as in a node's lib/
    spec = importlib.util.spec_from_file_location("nodectl_outputs_under_test", UPLOADER)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    monkeypatch.setattr(loaded, "QUIET", 0.3)
    return loaded


def run_folder(tmp_path, store, run_id: str, node: str = "node0"):
    run_dir = tmp_path / run_id / node
    for name in ("output", "logs", "metrics", "state", "lib"):
        (run_dir / name).mkdir(parents=True)
    config = {"url": f"s3://{BUCKET}/p", "every": 1, "endpoint_url": store.endpoint, "region": "us-east-1",
              "run_id": run_id, "node": node}
    (run_dir / "lib" / "outputs.json").write_text(json.dumps(config))
    return run_dir, config


def index_of(store, run_id: str, node: str = "node0") -> dict:
    body = store.client().get_object(Bucket=BUCKET, Key=f"p/{run_id}/{node}/nodectl-index.json")["Body"].read()
    return json.loads(body)["files"]


def test_an_upload_killed_mid_file_is_never_taken_and_its_parts_are_aborted(store, tmp_path):
    run_dir, config = run_folder(tmp_path, store, "killed")
    big = run_dir / "output" / "ckpt-1" / "model.bin"
    big.parent.mkdir()
    big.write_bytes(os.urandom(1 << 20) * 400)   # 400 MiB: several multipart parts
    os.utime(big, (time.time() - 60, time.time() - 60))
    env = dict(os.environ, **store.env)
    uploader = subprocess.Popen([sys.executable, str(UPLOADER), "sync", str(run_dir)], env=env)
    client = store.client()
    try:
        wait_for(lambda: client.list_multipart_uploads(Bucket=BUCKET, Prefix="p/killed/").get("Uploads"),
                 timeout=60, interval=0.05)
    finally:
        uploader.send_signal(signal.SIGKILL)
        uploader.wait()
    assert "p/killed/node0/output/ckpt-1/model.bin" not in store.objects(BUCKET, "p/killed")

    fresh = tmp_path / "fresh"
    (fresh / "lib").mkdir(parents=True)
    (fresh / "lib" / "outputs.json").write_text(json.dumps(config))
    pulled = subprocess.run([sys.executable, str(UPLOADER), "pull", str(fresh)], input='{"sources": '
                            '[{"node": "node0"}]}', capture_output=True, text=True, env=env)
    assert json.loads(pulled.stdout.splitlines()[-1])["files"] == 0, pulled.stdout + pulled.stderr
    assert not (fresh / "output" / "ckpt-1" / "model.bin").exists()

    # the next uploader of this node (a resumed attempt) aborts the parts left open, then sends the file whole
    again = subprocess.Popen([sys.executable, str(UPLOADER), "sync", str(run_dir)], env=env)
    try:
        wait_for(lambda: (run_dir / "state" / "upload.json").exists()
                 and json.loads((run_dir / "state" / "upload.json").read_text()).get("stored"), timeout=120)
    finally:
        again.send_signal(signal.SIGUSR1)
        assert again.wait(timeout=60) == 0
    assert not client.list_multipart_uploads(Bucket=BUCKET, Prefix="p/killed/").get("Uploads")
    assert index_of(store, "killed")["output/ckpt-1/model.bin"]["size"] == 400 << 20
    pulled = subprocess.run([sys.executable, str(UPLOADER), "pull", str(fresh)],
                            input='{"sources": [{"node": "node0"}]}', capture_output=True, text=True, env=env)
    assert json.loads(pulled.stdout.splitlines()[-1])["files"] == 1
    assert (fresh / "output" / "ckpt-1" / "model.bin").stat().st_size == 400 << 20


def round_while_sending(store, node: str, uploader, action) -> None:
    """One round of `uploader`, with `action` (what the run does) done while the round sends a file's parts."""
    client = store.client()

    def mid_upload():
        wait_for(lambda: client.list_multipart_uploads(Bucket=BUCKET, Prefix=f"p/{node}/").get("Uploads"),
                 timeout=60, interval=0.02)
        action()
    runner = threading.Thread(target=mid_upload)
    runner.start()
    uploader.round()
    runner.join()


def test_a_file_changed_while_sent_is_not_vouched_for(module, store, tmp_path):
    run_dir, config = run_folder(tmp_path, store, "changing")
    target = run_dir / "output" / "metrics.bin"
    target.write_bytes(os.urandom(1 << 20) * 200)
    os.utime(target, (time.time() - 60, time.time() - 60))

    def append():   # the run appends while the client is sending the file's parts
        with open(target, "ab") as handle:
            handle.write(b"b" * 10)
    uploader = module.Uploader(str(run_dir), config)
    round_while_sending(store, "changing", uploader, append)
    assert "output/metrics.bin" not in index_of(store, "changing")
    assert uploader.state.get("waiting") == 1
    time.sleep(0.4)
    uploader.round()
    assert index_of(store, "changing")["output/metrics.bin"]["size"] == (200 << 20) + 10


def test_a_file_the_run_removes_while_it_is_sent_leaves_nothing_in_the_store(module, store, tmp_path):
    """A checkpoint pruned by the run while a round sends it (the trainer keeps two; under load the round was
    still sending ckpt-10 when ckpt-30 replaced it): the object reached the store, no index vouched for it, and no
    later round removed it. It is removed as soon as the round sees its file gone."""
    run_dir, config = run_folder(tmp_path, store, "pruned")
    target = run_dir / "output" / "checkpoints" / "ckpt-0000010" / "rank0.pt"
    target.parent.mkdir(parents=True)
    target.write_bytes(os.urandom(1 << 20) * 100)
    os.utime(target, (time.time() - 60, time.time() - 60))

    def prune():
        target.unlink()
        target.parent.rmdir()
    uploader = module.Uploader(str(run_dir), config)
    round_while_sending(store, "pruned", uploader, prune)
    assert "output/checkpoints/ckpt-0000010/rank0.pt" not in index_of(store, "pruned")
    assert not [key for key in store.objects(BUCKET, "p/pruned") if "ckpt-0000010" in key]
    uploader.round(final=True)
    assert not [key for key in store.objects(BUCKET, "p/pruned") if "ckpt-0000010" in key]


def test_a_complete_marker_waits_for_the_rest_of_its_folder(module, store, tmp_path):
    run_dir, config = run_folder(tmp_path, store, "marker")
    folder = run_dir / "output" / "checkpoints" / "ckpt-0000010"
    folder.mkdir(parents=True)
    (folder / "COMPLETE").write_text("{}")
    os.utime(folder / "COMPLETE", (time.time() - 60, time.time() - 60))
    (folder / "rank0.pt").write_bytes(b"w" * 100)     # written just now: not still yet
    (run_dir / "output" / ".ckpt-0000020.tmp").mkdir()
    (run_dir / "output" / ".ckpt-0000020.tmp" / "rank0.pt").write_bytes(b"half")
    uploader = module.Uploader(str(run_dir), config)
    uploader.round()
    keys = store.objects(BUCKET, "p/marker")
    assert not any(key.endswith("COMPLETE") for key in keys), keys
    time.sleep(0.4)
    uploader.round()
    index = index_of(store, "marker")
    assert {"output/checkpoints/ckpt-0000010/COMPLETE", "output/checkpoints/ckpt-0000010/rank0.pt"} <= set(index)
    assert not any(".tmp" in rel for rel in index), "a checkpoint being written is never sent"


def test_messages_never_hold_the_secret(module, store, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-value-123")
    text = module.describe(RuntimeError("signature for s3cr3t-value-123 did not match"))
    assert "s3cr3t-value-123" not in text and "***" in text
