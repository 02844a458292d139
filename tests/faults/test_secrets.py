"""Canary secrets of every form in the inventory reach the ranks and nothing else: no dump, report, manifest,
script, log nodectl writes, file `collect` brings home, or command line that ps shows. The forms: a variable named
like a secret, a URL's user:password@, a presigned URL's signature in its query and in its fragment, a
token-shaped value under an innocent name, and a signature on the source line a stack dump quotes."""
from __future__ import annotations

import hashlib
import stat
import subprocess
from pathlib import Path

import pytest

from support.cli import run_nodectl
from support.launch import kill_leftovers, latest_run_id, wait_for
from support.sshcluster import LOGIN_SECRET

pytestmark = pytest.mark.slow
CANARY = "hf_canary_5e1f0c0ffee"
SIGNED = "f00dsig4242canaryq"       # DATA_URL's ?X-Amz-Signature=
FRAGMENT = "f00dsig4242canaryf"     # MIRROR_URL's #sig=
SHAPED = "ghp_" + "C4n4ryT0k3n" * 3  # a GitHub token's shape under an innocent name
SOURCE = "f00dsig4242canarys"       # on the line the rank sleeps on: a stack dump quotes it
PLANTED = (CANARY, SIGNED, FRAGMENT, SHAPED)
SCRIPT = f'''\
import hashlib, os, time
for name in ("HF_TOKEN", "DATA_URL", "MIRROR_URL", "MODEL_SOURCE"):
    print(name, "digest", hashlib.sha256(os.environ[name].encode()).hexdigest(), flush=True)
print("url", os.environ["PIP_INDEX_URL"].split("@")[-1], flush=True)
time.sleep(60); url = "http://minio:9000/b?X-Amz-Signature={SOURCE}"
'''


def files_under(root: Path):
    return [p for p in root.rglob("*") if p.is_file()]


def test_canary_secret_is_nowhere_but_the_ranks(ssh_cluster, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "show.py").write_text(SCRIPT)
    (project / "settings.py").write_text(f"TOKEN = {CANARY!r}   # a copy of the inventory's secret\n")
    env_block = {"HF_TOKEN": CANARY, "PIP_INDEX_URL": f"https://user:{CANARY}@pypi.example/simple",
                 "DATA_URL": f"https://data.example/shard0?X-Amz-Credential=AKID%2F20261129&X-Amz-Signature={SIGNED}",
                 "MIRROR_URL": f"https://mirror.example/model#sig={FRAGMENT}", "MODEL_SOURCE": SHAPED}
    # the inventory kept in the project, as the README's quick start has it: `--sync .` must not carry it
    inventory = str(ssh_cluster.inventory(project / "hosts.yaml", count=2, env=env_block))
    env = ssh_cluster.env()
    outputs = []
    outputs.append(run_nodectl(["-i", inventory, "launch", "--dry-run", "--", "show.py"], env=env, cwd=project))
    outputs.append(run_nodectl(["-i", inventory, "--json", "env-dump"], env=env, cwd=project))
    dumped = run_nodectl(["-i", inventory, "env-dump", "-o", str(tmp_path / "dumps")], env=env, cwd=project)
    assert dumped.exit_code == 0 and len(files_under(tmp_path / "dumps")) == 2, dumped.output
    dump = (tmp_path / "dumps" / "node0.json").read_text()
    assert '"DB_PASS": "***"' in dump and LOGIN_SECRET not in dump   # node0's shell exports it
    outputs.append(dumped)
    launched = run_nodectl(["-i", inventory, "launch", "--detach", "--", "show.py"], env=env, cwd=project)
    assert launched.exit_code == 0, launched.output
    for said in (outputs[0].stderr, launched.stderr):   # the dry run and the launch say what stays behind
        assert "hosts.yaml is not synced: the inventory in use" in said, said
        assert "settings.py is not synced: it holds the value of a secret setting" in said, said
    outputs.append(launched)
    run_id = latest_run_id(project)
    try:
        log = ssh_cluster.nodes[1].workdir / "runs" / run_id / "logs" / "rank1.log"
        wait_for(lambda: log.exists() and "url " in log.read_text())
        for name in ("HF_TOKEN", "DATA_URL", "MIRROR_URL", "MODEL_SOURCE"):   # the ranks got the real values
            assert hashlib.sha256(env_block[name].encode()).hexdigest() in log.read_text(), name
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        outputs += [run_nodectl(["--json", "status"], env=env, cwd=project),
                    run_nodectl(["tail", "all"], env=env, cwd=project),
                    run_nodectl(["stacks"], env=env, cwd=project)]
        assert "time.sleep(60)" in outputs[-1].output, outputs[-1].output   # the quoted line, masked
        collected = run_nodectl(["collect"], env=env, cwd=project)
        assert collected.exit_code == 0, collected.output
        outputs.append(collected)
        brought = files_under(project / "runs" / run_id / "nodes")
        assert any(p.name.endswith(".answer.json") for p in brought), brought   # the stack dump's raw answers
        assert not any(p.name == "env.sh" for p in brought), brought
        for value in PLANTED:
            assert value not in ps, value
        for result in outputs:
            for value in PLANTED + (SOURCE, LOGIN_SECRET):
                assert value not in result.output, (value, result.output)
        for path in files_under(project / "runs"):
            text = path.read_text(errors="replace")
            for value in PLANTED + (SOURCE,):
                assert value not in text, (value, path)
        for node in ssh_cluster.nodes[:2]:
            run_dir = node.workdir / "runs" / run_id
            assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
            assert stat.S_IMODE((run_dir / "env.sh").stat().st_mode) == 0o600
            for path in files_under(run_dir) + files_under(node.workdir / ".nodectl" / "objects"):
                if path.name != "env.sh":
                    text = path.read_text(errors="replace")
                    for value in PLANTED:
                        assert value not in text, (value, path)
            assert not (run_dir / "code" / "hosts.yaml").exists() and not (run_dir / "code" / "settings.py").exists()
    finally:
        run_nodectl(["stop", "--grace", "1"], env=env, cwd=project)
        kill_leftovers(run_id)
