"""A wheel carries launchers/, templates/ and the trainer, and an installed nodectl runs env-dump with them."""
from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


def test_wheel_install_runs_env_dump(tmp_path):
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"),
                            str(REPO)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("nodectl-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for shipped in ("nodectl/resources/launchers/probe.py", "nodectl/resources/launchers/runctl.py",
                    "nodectl/resources/launchers/rankexec.py", "nodectl/resources/templates/launch_node.sh.j2",
                    "nodectl/resources/trainer/loop.py", "nodectl/resources/trainer/demo.yaml"):
        assert shipped in names
    target = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                                str(wheel)], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-2000:]
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "NODECTL_FORCE_CPU": "1"}
    where = subprocess.run([sys.executable, "-c", "import nodectl.resources as r; print(r.resource_dir('launchers'))"],
                           env=env, cwd=tmp_path, capture_output=True, text=True)
    assert where.stdout.strip().startswith(str(target)), where.stdout + where.stderr
    dump = subprocess.run([sys.executable, "-m", "nodectl", "--json", "env-dump"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert dump.returncode == 0, dump.stderr[-2000:]
    assert '"probe_version": 1' in dump.stdout
