from __future__ import annotations

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodectl.errors import InventoryError, UsageError
from nodectl.inventory import Inventory, builtin_inventory, load_inventory, parse_inventory

SPEC_EXAMPLE = """\
master_port: 29500
defaults:
  user: ubuntu
  port: 22
  identity_file: ~/.ssh/id_ed25519
  gpus: 8
  device: cuda
  python: /opt/venv/bin/python3
  workdir: ~/nodectl
  env:
    NCCL_SOCKET_IFNAME: ens1
nodes:
  - host: 10.0.0.11
    name: node0
    addr: 10.0.1.11
  - host: 10.0.0.12
    env: {NCCL_IB_HCA: mlx5_0}
  - host: localhost
    transport: local
"""


def test_spec_example_merges_defaults_per_node():
    inv = parse_inventory(SPEC_EXAMPLE, "hosts.yaml")
    node0, node1, local = inv.nodes
    assert inv.master_port == 29500
    assert (node0.name, node0.host, node0.addr, node0.gpus, node0.user) == ("node0", "10.0.0.11", "10.0.1.11", 8, "ubuntu")
    assert node1.name == node1.addr == "10.0.0.12"
    assert node1.env == {"NCCL_SOCKET_IFNAME": "ens1", "NCCL_IB_HCA": "mlx5_0"}
    assert local.is_local and [n.index for n in inv.nodes] == [0, 1, 2]


def test_select_first_n_after_exclude():
    inv = parse_inventory(SPEC_EXAMPLE)
    assert [n.name for n in inv.select(2).nodes] == ["node0", "10.0.0.12"]
    assert [n.name for n in inv.select(2, exclude=("node0",)).nodes] == ["10.0.0.12", "localhost"]
    with pytest.raises(UsageError, match="--nodes 4 asked"):
        inv.select(4)
    with pytest.raises(UsageError, match="names no node"):
        inv.select(exclude=("nope",))


def test_host_ranges_expand_with_padding_and_names_alongside():
    inv = parse_inventory("defaults: {gpus: 4}\nnodes:\n  - host: 10.0.0.[9-11]\n    name: gpu[08-10]\n"
                          "  - host: login\n  - host: rack[1-2]-n[1,3]\n", "hosts.yaml")
    assert [(n.name, n.host, n.index) for n in inv.nodes][:4] == [
        ("gpu08", "10.0.0.9", 0), ("gpu09", "10.0.0.10", 1), ("gpu10", "10.0.0.11", 2), ("login", "login", 3)]
    assert [n.name for n in inv.nodes][4:] == ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]
    assert all(n.gpus == 4 for n in inv.nodes)
    assert [n.name for n in inv.select(("gpu[09-10]", "rack2-n1")).nodes] == ["gpu09", "gpu10", "rack2-n1"]
    assert [n.name for n in inv.select(2, exclude=("gpu[08-09]",)).nodes] == ["gpu10", "login"]
    with pytest.raises(UsageError, match=r"--nodes names no node of hosts.yaml: gpu\[11-12\]"):
        inv.select(("gpu11", "gpu12"))


def test_hostlist_expands_splits_and_folds():
    from nodectl.hostlist import expand, expand_list, fold

    assert expand("n[01-03,7]") == ["n01", "n02", "n03", "n7"]
    assert expand_list("a,n[1,3-4],b") == ["a", "n1", "n3", "n4", "b"]
    assert fold(["n01", "n02", "n03", "n05", "login", "gpu1", "gpu2"]) == "n[01-03,05],gpu[1-2],login"
    for bad in ("n[3-1]", "n[a-b]", "n[1-2", "n[0-99999]"):
        with pytest.raises(UsageError, match="host range"):
            expand(bad)


@pytest.mark.parametrize("text,needle,line", [
    ("nodes:\n  - host: a\n    gpus: eight\n", "nodes[0].gpus: an integer 1-1024", 3),
    ("defaults:\n  gpu: 8\nnodes: [{host: a}]\n", "defaults.gpu: unknown key", 2),
    ("defaults:\n  host: x\nnodes: [{host: a}]\n", "host, name and addr belong to each node", 2),
    ("nodes:\n  - host: n[1-3]\n    name: m[1-2]\n", "nodes[0].name: a range of 3 names like host", 3),
    ("nodes:\n  - host: n[2-1]\n", "runs backwards", 2),
    ("nodes:\n  - host: n[1-2]\n  - host: n2\n", "duplicate node name 'n2'", 3),
    ("nodes:\n  - host: a\n  - host: b\n    colour: red\n", "nodes[1].colour: unknown key", 4),
    ("nodes:\n  - host: a\n  - host: a\n", "duplicate node name 'a'", 3),
    ("nodes:\n  - name: x\n", "nodes[0].host", 2),
    ("master_port: 99999\nnodes: [{host: a}]\n", "master_port: a TCP port", 1),
    ("nodes:\n  - host: a\n    device: tpu\n", "'cuda' or 'cpu'", 3),
    ("nodes: [{host: a, env: {1BAD: x}}]\n", "environment variable name", 1),
    ("nodes:\n  - host: a\n  bad: [\n", "not valid YAML", None),
    ("nodes: []\n", "non-empty list", 1),
    ("- just\n- a list\n", "a mapping with a 'nodes:' list", None),
])
def test_errors_name_file_line_key_and_expectation(text, needle, line):
    with pytest.raises(InventoryError) as info:
        parse_inventory(text, "cluster.yaml")
    message = info.value.format_message()
    assert needle in message and message.startswith("cluster.yaml")
    if line:
        assert message.startswith(f"cluster.yaml:{line}:")
    assert info.value.exit_code == 2


def test_missing_file_is_an_inventory_error(tmp_path):
    with pytest.raises(InventoryError, match="not found"):
        load_inventory(tmp_path / "nope.yaml")


def test_deepspeed_hostfile():
    inv = parse_inventory("# cluster\nworker-1 slots=8\nworker-2 slots=4\n", "hostfile")
    assert [(n.host, n.gpus, n.index) for n in inv.nodes] == [("worker-1", 8, 0), ("worker-2", 4, 1)]


def test_builtin_default_gives_n_local_nodes(monkeypatch):
    monkeypatch.setenv("NODECTL_FORCE_CPU", "1")
    inv = builtin_inventory().select(3)
    assert [n.name for n in inv.nodes] == ["local0", "local1", "local2"]
    assert all(n.is_local and n.device == "cpu" and n.gpus == 1 for n in inv.nodes)


scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 70000), st.text(max_size=12))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(
        ["host", "name", "gpus", "port", "env", "nodes", "defaults", "device", "x", "transport"]), inner, max_size=4)),
    max_leaves=12)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.one_of(values.map(lambda v: yaml.safe_dump(v)), st.text(max_size=80)))
def test_any_document_parses_or_raises_inventory_error(text):
    try:
        result = parse_inventory(text, "fuzz.yaml")
    except InventoryError as exc:
        assert exc.format_message().startswith("fuzz.yaml")
    else:
        assert isinstance(result, Inventory) and result.nodes
