"""An ~/.ssh/config alias as `host:` is how the user reaches a node, not an address the other nodes can resolve:
the master address (and every node's `addr`) is the alias's HostName unless `addr:` says otherwise."""
from __future__ import annotations

import subprocess
import sys


def test_an_ssh_alias_renders_its_hostname_as_the_master_address(tmp_path):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text("Host gpu-a\n  HostName 10.1.2.3\nHost gpu-b\n  HostName 10.1.2.4\n")
    (tmp_path / "train.py").write_text("print('x')\n")
    (tmp_path / "hosts.yaml").write_text("defaults: {device: cpu}\nnodes:\n  - {host: gpu-a}\n  - {host: gpu-b}\n"
                                         "  - {host: gpu-c, addr: 10.9.9.9}\n")
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "COLUMNS": "200"}
    done = subprocess.run([sys.executable, "-m", "nodectl", "launch", "--dry-run", "--nodes", "2", "--", "train.py"],
                          capture_output=True, text=True, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    assert "--master-addr=10.1.2.3" in done.stdout and "gpu-a" not in done.stdout.split("--master-addr=")[1][:20]
    assert "NODECTL" in done.stdout
