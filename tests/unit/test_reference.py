"""docs/REFERENCE.md, the user's contract, kept true: its commands, options, inventory keys and exit codes exist."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from nodectl import errors
from nodectl.cli import main
from nodectl.inventory import parse_inventory

REFERENCE = (Path(__file__).resolve().parents[2] / "docs" / "REFERENCE.md").read_text()
PLANNED = "*(planned"


def test_the_readme_points_at_the_reference_and_nothing_outside_the_project():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert "docs/REFERENCE.md" in readme and "../shared" not in readme


def test_every_command_in_the_table_exists_with_its_options():
    rows = [line for line in REFERENCE.splitlines() if line.startswith("| `nodectl ")]
    assert len(rows) >= 10
    for row in rows:
        usage = row.split("`")[1]
        name = usage.split()[1]
        if PLANNED in row:
            assert name not in main.every_command, f"{name} is built: drop its (planned) mark in docs/REFERENCE.md"
            continue
        command = main.every_command[name]
        params = [*command.params, *main.params]   # global options are taken after the command too
        known = {opt for param in params for opt in getattr(param, "opts", []) + getattr(param, "secondary_opts", [])}
        for option in re.findall(r"(--[a-z][a-z-]*|-[a-zA-Z])\b", usage.split(name, 1)[1]):
            assert option in known, f"`nodectl {name}` has no {option} (docs/REFERENCE.md says it does)"


def test_the_inventory_example_parses_and_every_key_is_documented():
    example = REFERENCE.split("```yaml", 1)[1].split("```", 1)[0]
    inventory = parse_inventory(example, "hosts.yaml")
    assert [n.name for n in inventory.nodes] == ["node0", "10.0.0.12", "localhost"]
    assert inventory.nodes[1].env == {"NCCL_SOCKET_IFNAME": "ens1", "NCCL_IB_HCA": "mlx5_0"}
    environments = REFERENCE.split("```yaml", 2)[2].split("```", 1)[0]   # container: or environment:
    documented = set(yaml.safe_load(example)["defaults"]) | set(yaml.safe_load(environments)["defaults"]) | \
        {"host", "name", "addr", "transport", "env"}
    from nodectl.inventory import NODE_KEYS, TOP_KEYS
    assert NODE_KEYS - {"outputs"} <= documented, f"keys missing from docs/REFERENCE.md: {sorted(NODE_KEYS - documented)}"
    stores = REFERENCE.split("```yaml", 3)[3].split("```", 1)[0]   # outputs:
    with_outputs = parse_inventory(stores + "nodes: [{host: a}, {host: b}]\n", "hosts.yaml")
    assert {n.outputs.url for n in with_outputs.nodes} == {"s3://team-ckpts/glm-lora"}
    assert with_outputs.nodes[1].outputs.every == 600
    from nodectl.outputs import KEYS
    assert set(yaml.safe_load(stores)["defaults"]["outputs"]) == KEYS
    assert NODE_KEYS <= documented | set(yaml.safe_load(stores)["defaults"])
    assert TOP_KEYS <= set(yaml.safe_load(example)) | {"outputs"}


def test_exit_codes_are_the_documented_ones():
    line = next(line for line in REFERENCE.splitlines() if "Exit codes:" in line)
    text = line + REFERENCE.split(line, 1)[1][:200]
    documented = {int(n) for n in re.findall(r"(\d+) (?:success|a check failed|usage|a node could not|interrupted)", text)}
    assert documented == {errors.EXIT_OK, errors.EXIT_FAILED, errors.EXIT_USAGE, errors.EXIT_UNREACHABLE,
                          errors.EXIT_INTERRUPTED}


def test_nothing_marked_planned_is_built():
    """A key or command named near a "planned" mark must not exist (the page once called container: and
    environment: planned long after both worked)."""
    from nodectl.inventory import NODE_KEYS

    for found in re.finditer(r"planned", REFERENCE):
        around = REFERENCE[max(0, found.start() - 300):found.end() + 300]
        for name in re.findall(r"`([a-z_-]+):?`", around):
            assert name not in NODE_KEYS and name not in main.every_command, \
                f"docs/REFERENCE.md calls `{name}` planned near: {around!r}"


def test_every_command_is_documented_and_every_launch_option_named_exists():
    documented = set(re.findall(r"`nodectl ([a-z-]+)", REFERENCE))
    built = {name: command.name for name, command in main.every_command.items()}
    assert all(name == found for name, found in built.items()), built   # each module's command, by its own name
    assert set(built) <= documented, f"undocumented commands: {sorted(set(built) - documented)}"
    assert documented <= set(built), f"documented, not built: {sorted(documented - set(built))}"
    launch = main.every_command["launch"]
    known = {opt for param in launch.params for opt in getattr(param, "opts", [])}
    intro = REFERENCE.split("## 1.", 1)[0]
    for option in re.findall(r"`(--[a-z][a-z-]*)", intro):
        assert option in known, f"docs/REFERENCE.md names launch {option}, which does not exist"


def test_the_variables_a_program_sees_are_the_ones_nodectl_sets():
    from nodectl.inventory import OWN_ENV

    section = REFERENCE.split("## 4.", 1)[1].split("## 5.", 1)[0]
    named = set(re.findall(r"`(NODECTL_[A-Z_]+)`", section))
    assert named <= OWN_ENV, f"documented but never set: {sorted(named - OWN_ENV)}"
    for variable in ("NODECTL_RUN_ID", "NODECTL_RUN_DIR", "NODECTL_OUTPUT_DIR", "NODECTL_NODE_RANK", "NODECTL_NNODES",
                     "NODECTL_ATTEMPT"):
        assert variable in named


def test_a_command_loads_its_own_module_and_not_the_others():
    """`nodectl status` imports status's module, not launch's or preflight's: a command's start-up pays for itself."""
    import subprocess
    import sys

    probe = ("import sys\nfrom nodectl.cli import main\nmain.get_command(None, 'status')\n"
             "print(sorted(m for m in sys.modules if m.startswith('nodectl.cli.')))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert "'nodectl.cli.status'" in loaded and "nodectl.cli.launch'" not in loaded \
        and "nodectl.cli.preflight'" not in loaded, loaded
