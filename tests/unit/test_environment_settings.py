"""`environment:` settings, the lock's hash and the wheel tags fetched for the nodes' platform (which need not be
the controller's); the build itself runs for real in tests/integration/test_environments.py and test_runctl.py."""
from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest

from nodectl import environment as environments
from nodectl.errors import InventoryError, UsageError
from nodectl.inventory import parse_inventory


def test_the_lock_is_read_from_the_project_and_its_hash_keys_the_venv(tmp_path):
    (tmp_path / "requirements.txt").write_text("six==1.16.0\n")
    inventory = parse_inventory("defaults: {environment: requirements.txt}\nnodes: [{host: a}, {host: b}]")
    bound = environments.bind_locks(inventory, tmp_path)
    expected = hashlib.sha256(b"six==1.16.0\n").hexdigest()
    assert {n.environment.lock_sha for n in bound.nodes} == {expected}
    (tmp_path / "requirements.txt").write_text("six==1.17.0\n")
    assert environments.bind_locks(inventory, tmp_path).nodes[0].environment.lock_sha != expected
    index = parse_inventory("nodes: [{host: a, environment: {file: requirements.txt, install: index}}]")
    assert environments.bind_locks(index, tmp_path).nodes[0].environment.lock_sha != expected  # resolved elsewhere


def test_a_missing_lock_is_a_usage_error_naming_it(tmp_path):
    inventory = parse_inventory("nodes: [{host: a, environment: reqs/missing.txt}]")
    with pytest.raises(UsageError, match="reqs/missing.txt is not in the project"):
        environments.bind_locks(inventory, tmp_path)


@pytest.mark.parametrize("value,expected", [
    ("/etc/passwd", "relative, no .."), ("../outside.txt", "relative, no .."),
    ({"file": "r.txt", "install": "conda"}, "one of wheels, index"),
    ({"file": "r.txt", "index_url": "pypi"}, "an index URL"), ({"path": "r.txt"}, "unknown key"), (3, "a requirements"),
])
def test_bad_environment_settings_name_the_key(value, expected):
    with pytest.raises(InventoryError, match=expected):
        parse_inventory({"nodes": [{"host": "a", "environment": value}]}.__repr__().replace("'", '"'))


def test_launch_environment_refuses_container_nodes():
    inventory = parse_inventory("nodes: [{host: a, container: img:1}]")
    with pytest.raises(UsageError, match="run in a container"):
        environments.with_environment(inventory, "requirements.txt")


def test_wheel_tags_follow_the_nodes_platform_not_the_controllers():
    tags = environments.pip_platforms("aarch64", "glibc", "2.31")
    assert tags[0] == "manylinux_2_31_aarch64" and tags[-1] == "manylinux2014_aarch64"
    assert "manylinux_2_17_aarch64" in tags and not any("x86_64" in t for t in tags)
    assert environments.pip_platforms("x86_64", "glibc", "2.28")[-2:] == ["manylinux2010_x86_64", "manylinux1_x86_64"]
    assert environments.pip_platforms("x86_64", "musl", "") == ["linux_x86_64"]   # no manylinux on musl
    node = SimpleNamespace(implementation="cpython", python="3.12", machine="aarch64", libc="glibc", libc_version="2.35")
    args = environments._target_args(node)
    assert args[:5] == ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    assert args[args.index("--platform") + 1] == "manylinux_2_35_aarch64"
