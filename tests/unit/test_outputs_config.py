"""`outputs:` as typed: what is refused (exit 2, the key named), what the launch script does with it, and what is
recorded (the URL, never a credential)."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import yaml

from nodectl.errors import InventoryError, UsageError
from nodectl.inventory import parse_inventory
from nodectl.outputs import from_option
from nodectl.plan import build_plan
from nodectl.render import render_plan

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCY-secret"


def inventory(outputs) -> str:
    return yaml.safe_dump({"defaults": {"device": "cpu", "env": {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLE",
                                                                 "AWS_SECRET_ACCESS_KEY": SECRET}},
                           "nodes": [{"host": "10.0.0.11", "name": "node0"}, {"host": "10.0.0.12", "name": "node1"}],
                           "outputs": outputs})


@pytest.mark.parametrize("outputs, key, words", [
    ("s3://AKIA:secret@bucket/x", "outputs.url", "no credentials"),
    ("https://bucket.s3.amazonaws.com/x", "outputs.url", "s3://bucket/prefix"),
    ("s3://Bad_Bucket/x", "outputs.url", "bucket name"),
    ("s3://bucket/a/../b", "outputs.url", "'..'"),
    ({"url": "s3://bucket/x", "every": "often"}, "outputs.every", "30s, 10m"),
    ({"url": "s3://bucket/x", "every": 0}, "outputs.every", "at least 1"),
    ({"url": "s3://bucket/x", "endpoint_url": "http://key:secret@minio:9000"}, "outputs.endpoint_url", "without"),
    ({"url": "s3://bucket/x", "bucket": "y"}, "outputs.bucket", "unknown key"),
])
def test_a_bad_outputs_setting_names_its_key(outputs, key, words):
    with pytest.raises(InventoryError) as caught:
        parse_inventory(inventory(outputs))
    assert key in str(caught.value) and words in str(caught.value)
    assert ":secret@" not in str(caught.value), "a credential in a refused value is not echoed"


SIGNED = ["http://127.0.0.1:9000/?X-Amz-Signature=f00dsig4242", "http://minio:9000/?AWSAccessKeyId=AKID&Signature=f00dsig4242",
          "http://minio:9000/#X-Amz-Signature=f00dsig4242", "http://minio:9000/pre?token=f00dsig4242"]


@pytest.mark.parametrize("endpoint", SIGNED)
def test_a_signature_in_the_endpoint_url_is_refused_and_never_echoed(endpoint):
    """Round four's high finding: these were accepted, stored in the manifest and the node's files, and shown."""
    with pytest.raises(InventoryError) as caught:
        parse_inventory(inventory({"url": "s3://bucket/x", "endpoint_url": endpoint}))
    said = str(caught.value)
    assert "outputs.endpoint_url" in said and "without credentials, query or fragment" in said
    assert "f00dsig4242" not in said and "AKID" not in said


@pytest.mark.parametrize("url", ["s3://bucket/x?X-Amz-Signature=f00dsig4242", "s3://bucket/x#sig=f00dsig4242",
                                 "s3://bucket/x?AWSAccessKeyId=AKID&Signature=f00dsig4242",
                                 "s3://bucket/pre?token=f00dsig4242"])
def test_a_refused_outputs_url_is_echoed_without_its_signature(url):
    with pytest.raises(UsageError) as caught:
        from_option(url, None)
    assert "--outputs" in str(caught.value) and "no credentials" in str(caught.value)
    assert "f00dsig4242" not in str(caught.value) and "AKID" not in str(caught.value)


@pytest.mark.parametrize("every, seconds", [("30s", 30), ("10m", 600), ("1h", 3600), (45, 45), ("2.5m", 150)])
def test_every_reads_as_a_duration(every, seconds):
    parsed = parse_inventory(inventory({"url": "s3://bucket/runs/", "every": every})).outputs
    assert parsed.every == seconds and parsed.url == "s3://bucket/runs"


def test_the_launch_script_runs_the_uploader_beside_torchrun_and_waits_for_its_last_round(tmp_path):
    plan = build_plan(parse_inventory(inventory("s3://bucket/team")), gpus=1, command=("train.py",),
                      sync_dir=str(tmp_path), run_id="20260101-000000-abcd")
    script = render_plan(replace(plan, created=0.0))[1].launch
    path = tmp_path / "launch.sh"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    uploader = script.index('nodectl_outputs.py" sync "$RUN_DIR"')
    torchrun = script.index('lib/elastic_agent.py" \\')
    signal_last = script.index('kill -USR1 "$UPLOADER"')
    assert uploader < torchrun < signal_last and script.rstrip().endswith('exit "$code"')
    assert SECRET not in script
    recorded = json.dumps(plan.to_json())
    assert "s3://bucket/team" in recorded and SECRET not in recorded


def test_without_outputs_the_script_has_no_uploader(tmp_path):
    plan = build_plan(parse_inventory(inventory(None)), gpus=1, command=("train.py",), sync_dir=str(tmp_path))
    assert "UPLOADER" not in render_plan(plan)[0].launch


@pytest.mark.slow
def test_launch_outputs_option_is_checked_before_any_node_is_touched(tmp_path):
    (tmp_path / "train.py").write_text("print('x')\n")
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(inventory(None))
    done = subprocess.run([sys.executable, "-m", "nodectl", "-i", str(hosts), "launch", "--dry-run", "--outputs",
                           "s3://k:s@bucket/x", "--", "train.py"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2 and "--outputs" in done.stderr and "no credentials" in done.stderr
    shown = subprocess.run([sys.executable, "-m", "nodectl", "-i", str(hosts), "launch", "--dry-run", "--outputs",
                            "s3://bucket/x", "--", "train.py"], capture_output=True, text=True, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "nodectl_outputs.py\" sync" in shown.stdout and SECRET not in shown.stdout + shown.stderr


def test_outputs_in_defaults_per_node_and_at_the_top():
    """SPEC's form is a node setting (defaults or per node); a top-level outputs: is every other node's."""
    document = yaml.safe_dump({"defaults": {"device": "cpu", "outputs": {"url": "s3://team-ckpts/a", "every": "30s"}},
                               "nodes": [{"host": "h0", "name": "node0"},
                                         {"host": "h1", "name": "node1", "outputs": "s3://eu-ckpts/b"}]})
    nodes = parse_inventory(document).nodes
    assert nodes[0].outputs.url == "s3://team-ckpts/a" and nodes[0].outputs.every == 30
    assert nodes[1].outputs.url == "s3://eu-ckpts/b" and nodes[1].outputs.every == 600
    plan = build_plan(parse_inventory(document), gpus=1, command=("train.py",), sync_dir="/src",
                      run_id="20260101-000000-abcd")
    scripts = render_plan(plan)
    assert "s3://team-ckpts/a/20260101-000000-abcd/" in scripts[0].launch
    assert "s3://eu-ckpts/b/20260101-000000-abcd/" in scripts[1].launch
    top = yaml.safe_dump({"outputs": "s3://all-ckpts/x", "defaults": {"device": "cpu"},
                          "nodes": [{"host": "h0"}, {"host": "h1", "outputs": "s3://mine-only/y"}]})
    assert [n.outputs.url for n in parse_inventory(top).nodes] == ["s3://all-ckpts/x", "s3://mine-only/y"]
    bad = yaml.safe_dump({"nodes": [{"host": "h0", "outputs": {"url": "s3://k:s@bucket/x"}}]})
    with pytest.raises(InventoryError) as caught:
        parse_inventory(bad)
    assert "nodes[0].outputs.url" in str(caught.value) and ":s@" not in str(caught.value)
