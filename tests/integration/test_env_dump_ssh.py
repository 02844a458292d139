"""env-dump against real sshd nodes on loopback."""
from __future__ import annotations

import pytest

import json
import time

from support.cli import run_nodectl
from support.sshcluster import NODE_PYTHON


@pytest.mark.quick
def test_env_dump_table_json_and_output_folder(ssh_cluster, tmp_path):
    inventory = ssh_cluster.inventory()
    env = ssh_cluster.env()
    table = run_nodectl(["-i", str(inventory), "env-dump"], env=env)
    assert table.exit_code == 0, table.output
    for name in ("node0", "node1", "node2"):
        assert name in table.stdout
    assert "2.13" in table.stdout or "+cpu" in table.stdout  # the torch column

    out_dir = tmp_path / "dump"
    as_json = run_nodectl(["-i", str(inventory), "--json", "env-dump", "-o", str(out_dir)], env=env)
    assert as_json.exit_code == 0, as_json.output
    document = as_json.json()  # stdout holds the JSON document alone
    assert set(document["nodes"]) == {"node0", "node1", "node2"}
    report = document["nodes"]["node1"]
    assert report["torch"]["version"].startswith("2.")
    assert report["python"]["version"] and report["limits"]["nofile_soft"]
    assert report["disk"]["workdir"] == "/home/nodectl-zsh/nodectl"  # the node's own home, not a shared disk
    assert abs(report["clock"]["skew_s"]) < 2
    assert sorted(p.name for p in out_dir.iterdir()) == ["node0.json", "node1.json", "node2.json"]
    assert json.loads((out_dir / "node2.json").read_text())["node"]["host"] == ssh_cluster.nodes[2].address


def test_diff_shows_only_the_node_that_differs_and_redacts_secrets(ssh_cluster):
    inventory = ssh_cluster.inventory(node_overrides={2: {"env": {"NCCL_IB_HCA": "mlx5_9", "HF_TOKEN": "hf_canary"}}})
    # env: in the inventory is for launched processes; give node2's probe a different environment
    # through its python instead, as a node whose venv differs would.
    wrapper = ssh_cluster.node_file(2, "python-with-env.sh", "#!/bin/sh\nexport FAKE_DRIFT=yes HF_TOKEN=hf_canary\n"
                                    f"exec {NODE_PYTHON} \"$@\"\n", mode=0o755)
    inventory = ssh_cluster.inventory(node_overrides={2: {"python": wrapper}})
    result = run_nodectl(["-i", str(inventory), "--json", "env-dump", "--diff"], env=ssh_cluster.env())
    assert result.exit_code == 0, result.output
    diff = result.json()["diff"]
    assert diff["env.FAKE_DRIFT"] == {"node0": "<missing>", "node1": "<missing>", "node2": "yes"}
    assert diff["env.HF_TOKEN"]["node2"] == "***"
    assert "hf_canary" not in result.stdout + result.stderr
    assert not any(key.startswith(("clock.", "torch.")) for key in diff)

    human = run_nodectl(["-i", str(inventory), "env-dump", "--diff"], env=ssh_cluster.env())
    assert "FAKE_DRIFT" in human.stdout and "torch.version" not in human.stdout


def test_unreachable_node_exits_3_and_others_are_reported(ssh_cluster):
    inventory = ssh_cluster.inventory(extra_nodes=[{"host": "127.0.0.99", "name": "ghost", "workdir": "/tmp/g"}])
    started = time.monotonic()
    result = run_nodectl(["-i", str(inventory), "--connect-timeout", "2", "--json", "env-dump"],
                         env=ssh_cluster.env())
    elapsed = time.monotonic() - started
    assert result.exit_code == 3, result.output
    document = result.json()
    assert set(document["nodes"]) == {"node0", "node1", "node2"}
    assert "ghost" in document["errors"] and "127.0.0.99" in document["errors"]["ghost"]
    assert elapsed < 2 + 15  # the connect timeout, plus probing the others


def test_bad_inventory_exits_2_without_traceback(tmp_path):
    bad = tmp_path / "hosts.yaml"
    bad.write_text("nodes:\n  - host: a\n    gpus: lots\n")
    result = run_nodectl(["-i", str(bad), "env-dump"])
    assert result.exit_code == 2
    assert f"{bad}:3: nodes[0].gpus" in result.stderr and "Traceback" not in result.output


def test_unknown_host_key_refused_then_accepted_with_flag(fresh_cluster):
    inventory = fresh_cluster.inventory()
    env = fresh_cluster.env()
    refused = run_nodectl(["-i", str(inventory), "env-dump"], env=env)
    assert refused.exit_code == 3
    assert "unknown host key" in refused.stderr and "--accept-new-host-keys" in refused.stderr
    known_hosts = fresh_cluster.home / ".ssh" / "known_hosts"
    assert not known_hosts.exists()

    accepted = run_nodectl(["-i", str(inventory), "--accept-new-host-keys", "env-dump"], env=env)
    assert accepted.exit_code == 0, accepted.output
    assert f"[{fresh_cluster.nodes[0].address}]:2222" in known_hosts.read_text()
    again = run_nodectl(["-i", str(inventory), "env-dump"], env=env)  # now known: no flag needed
    assert again.exit_code == 0, again.output


def test_changed_host_key_always_refused(fresh_cluster):
    fresh_cluster.trust_host_keys()
    known_hosts = fresh_cluster.home / ".ssh" / "known_hosts"
    # Another machine answering at node0's address: keep the recorded key, give the server a new one.
    fresh_cluster.stop_node(0)
    fresh_cluster.nodes[0].host_key.unlink()
    fresh_cluster.nodes[0].host_key.with_suffix(".pub").unlink()
    import subprocess
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(fresh_cluster.nodes[0].host_key)],
                   check=True)
    fresh_cluster.restart_node(0)
    before = known_hosts.read_text()
    for flags in ([], ["--accept-new-host-keys"]):
        result = run_nodectl(["-i", str(fresh_cluster.inventory()), *flags, "env-dump"], env=fresh_cluster.env())
        assert result.exit_code == 3
        assert "HOST KEY CHANGED" in result.stderr
        assert f"ssh-keygen -R '[{fresh_cluster.nodes[0].address}]:2222'" in result.stderr  # the name known_hosts uses for that port
    assert known_hosts.read_text() == before


def test_ssh_config_alias_is_honoured(ssh_cluster, tmp_path):
    config = ssh_cluster.home / ".ssh" / "config"
    node = ssh_cluster.nodes[0]
    config.write_text(f"Host first-node\n  HostName {node.address}\n  Port {node.port}\n  User root\n"
                      f"  IdentityFile {ssh_cluster.identity}\n")
    try:
        inventory = tmp_path / "alias.yaml"
        inventory.write_text(f"nodes:\n  - host: first-node\n    device: cpu\n    workdir: /root/elsewhere\n"
                             f"    python: {NODE_PYTHON}\n")
        result = run_nodectl(["-i", str(inventory), "--json", "env-dump"], env=ssh_cluster.env())
        assert result.exit_code == 0, result.output
        assert result.json()["nodes"]["first-node"]["disk"]["workdir"] == "/root/elsewhere"
    finally:
        config.unlink()
