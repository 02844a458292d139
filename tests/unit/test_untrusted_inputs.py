"""Issue 29, the parts that are pure: what comes back from a compromised node, a hostile project's template,
escape sequences in node text, inventory values that would confuse nodectl's own bookkeeping."""
from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from nodectl.errors import InventoryError, UsageError
from nodectl.inventory import parse_inventory
from nodectl.plan import build_plan
from nodectl.remote.collect import unpack
from nodectl.render import render_plan
from nodectl.terminal_text import visible


def archive(tmp_path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    path = tmp_path / "node.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def entry(name: str, kind=tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, 0o644
    return info


def files_under(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def test_a_crafted_archive_writes_nothing_outside_the_run_folder(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    target = tmp_path / "runs" / "r1" / "nodes" / "n0"
    deep = "/".join(["d" * 200] * 30)   # the PATH_MAX trick of CVE-2025-4517 needs long link chains
    members = [
        (entry("logs/rank0.log"), b"fine\n"),
        (entry(str(outside / "abs.txt")), b"absolute"),
        (entry("../../../../outside/up.txt"), b"dotdot"),
        (entry("escape", tarfile.SYMTYPE, str(outside)), None),
        (entry("escape/through-link.txt"), b"through a link"),
        (entry("rel", tarfile.SYMTYPE, "../../../../outside"), None),
        (entry("rel/through-relative-link.txt"), b"through a relative link"),
        (entry("hard", tarfile.LNKTYPE, str(outside / "x")), None),
        (entry("fifo", tarfile.FIFOTYPE), None),
        (entry("dev", tarfile.CHRTYPE), None),
        (entry(deep + "/a", tarfile.SYMTYPE, "../" * 40 + "outside"), None),
        (entry("output/adapter-100/adapter_model.safetensors"), b"weights"),
        (entry("output/adapter", tarfile.SYMTYPE, "adapter-100"), None),
    ]
    refused = unpack(archive(tmp_path, members), target)
    assert files_under(outside) == set()
    assert (target / "logs" / "rank0.log").read_text() == "fine\n"
    assert os.readlink(target / "output" / "adapter") == "adapter-100"
    assert (target / "output" / "adapter" / "adapter_model.safetensors").read_bytes() == b"weights"
    assert len(refused) == 8 and not (target / "fifo").exists() and not (target / "dev").exists()
    # the refused link is not made; a file named under it lands in a real folder inside the run's
    assert (target / "escape").is_dir() and not (target / "escape").is_symlink()
    assert all(not p.is_symlink() or os.readlink(p) == "adapter-100" for p in target.rglob("*"))


def test_collecting_twice_replaces_the_sibling_link_and_never_writes_through_an_old_one(tmp_path):
    target = tmp_path / "n0"
    (target / "output").mkdir(parents=True)
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    (target / "output" / "metrics.jsonl").symlink_to(outside)   # left by anything: must not be written through
    members = [(entry("output/metrics.jsonl"), b"new"), (entry("output/adapter", tarfile.SYMTYPE, "adapter-2"), None)]
    refused = unpack(archive(tmp_path, members), target)
    assert outside.read_text() == "keep" and refused == ["output/metrics.jsonl"]
    unpack(archive(tmp_path, [(entry("output/adapter", tarfile.SYMTYPE, "adapter-3"), None)]), target)
    assert os.readlink(target / "output" / "adapter") == "adapter-3"


def plan_for(tmp_path: Path):
    inventory = parse_inventory("nodes:\n  - {host: localhost, name: n0, transport: local, device: cpu}\n")
    return build_plan(inventory, gpus=None, command=("train.py",), sync_dir=str(tmp_path), run_id="r1")


def test_a_projects_own_template_is_not_used_unless_asked(tmp_path):
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "launch_node.sh.j2").write_text("echo project template\n")
    [node] = render_plan(plan_for(tmp_path))
    assert "project template" not in node.launch and "rankexec.py" in node.launch


@pytest.mark.parametrize("payload", [
    "{{ cycler.__init__.__globals__.os.system('touch PWNED') }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ plan.__class__.__init__.__globals__ }}",
    "{% set x = np.env.update({'A': 'b'}) %}",
])
def test_a_hostile_template_cannot_reach_python_on_the_controller(tmp_path, payload, monkeypatch):
    monkeypatch.chdir(tmp_path)
    template = tmp_path / "evil.sh.j2"
    template.write_text(payload + "\n")
    with pytest.raises(UsageError, match="evil.sh.j2"):
        render_plan(plan_for(tmp_path), str(template))
    assert not (tmp_path / "PWNED").exists()


def test_terminal_escapes_from_a_node_are_shown_not_obeyed():
    hostile = "title\x1b]0;owned\x07 clip\x1b]52;c;ZXZpbA==\x07 clear\x1b[2J query\x1b[6n bidi\u202e"
    shown = visible(hostile)
    assert "\x1b" not in shown and "\x07" not in shown and "\u202e" not in shown
    assert "\\x1b]52;c;ZXZpbA==" in shown
    assert visible("loss \x1b[32m0.5\x1b[0m") == "loss \x1b[32m0.5\x1b[0m"   # colour is kept
    assert visible("a\tb\n") == "a\tb\n"


@pytest.mark.parametrize("text, words", [
    ("nodes:\n  - {host: a, name: '..'}\n", "not . or .."),
    ("nodes:\n  - {host: a, env: {NODECTL_RUN_ID: other}}\n", "NODECTL_RUN_ID"),
    ("defaults: {env: {nodectl_node_rank: '0'}}\nnodes:\n  - {host: a}\n", "NODECTL_NODE_RANK"),
])
def test_inventory_values_that_would_confuse_nodectl_are_refused(text, words):
    with pytest.raises(InventoryError, match=words.replace(".", r"\.")):
        parse_inventory(text)


def test_a_tracked_folder_replaced_by_a_link_out_of_the_project_sends_nothing_from_outside(tmp_path):
    """The audit's git project whose tracked `conf/` became a symlink to another folder: the file git still lists
    (conf/x.txt) was read through the link and a fake key from outside reached the nodes. Only files whose real
    path is inside the project travel; a link to a folder inside it still works."""
    import subprocess

    from nodectl.remote.sync import project_files

    project, outside = tmp_path / "project", tmp_path / "outside"
    (project / "conf").mkdir(parents=True)
    (project / "conf" / "x.txt").write_text("mine\n")
    (project / "data").mkdir()
    (project / "data" / "y.txt").write_text("also mine\n")
    (project / "train.py").write_text("print(1)\n")
    git = ["git", "-C", str(project), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "init"], check=True)
    outside.mkdir()
    (outside / "x.txt").write_text("FAKE PRIVATE KEY\n")
    for name in ("conf", "data"):
        for item in (project / name).iterdir():
            item.unlink()
        (project / name).rmdir()
    (project / "conf").symlink_to(outside)
    (project / "data").symlink_to(project / "inner")
    (project / "inner").mkdir()
    (project / "inner" / "y.txt").write_text("inside, through a link\n")
    sent = {f.path: f.source.read_text() for f in project_files(project)}
    assert "code/conf/x.txt" not in sent and "FAKE PRIVATE KEY\n" not in sent.values()
    assert sent["code/data/y.txt"] == "inside, through a link\n" and "code/train.py" in sent


def test_a_name_the_file_system_will_not_take_is_refused_and_the_rest_unpacked(tmp_path):
    """A 300-character file name in a node's archive (issue 40) aborted that node's whole collect with a raw
    OSError; it is now one refused entry, and the node's other files come home."""
    long_name = "output/" + "x" * 300 + ".bin"
    members = [(entry("logs/rank0.log"), b"fine\n"), (entry(long_name), b"data"), (entry("output/ok.txt"), b"ok")]
    target = tmp_path / "home"
    refused = unpack(archive(tmp_path, members), target)
    assert refused == [long_name[:200]]
    assert (target / "logs" / "rank0.log").read_bytes() == b"fine\n" and (target / "output" / "ok.txt").is_file()


def test_a_recorded_plan_reads_back_as_one_and_a_crafted_one_is_refused_by_field():
    """--resume reads the manifest's plan through LaunchPlan.from_json, checked like the inventory: the plan a
    launch recorded comes back whole (its secrets as recorded: ***), and a record with a wrong type, a node name
    that is a path, a python of two lines, or a rank count out of range is a UsageError naming the field
    (exit 2), never a KeyError or a Node built from whatever the record said."""
    import copy
    import json

    from nodectl.errors import UsageError
    from nodectl.inventory import parse_inventory
    from nodectl.plan import LaunchPlan, build_plan

    inventory = parse_inventory("master_port: 29500\ndefaults: {gpus: 2, env: {HF_TOKEN: hf_secret_value}}\n"
                                "nodes:\n  - {host: 10.0.0.11, name: node0}\n  - {host: 10.0.0.12, name: node1}\n")
    plan = build_plan(inventory, gpus=None, command=("train.py", "--hf-token", "x"), sync_dir="/src/project",
                      run_id="20260101-000000-abcd")
    recorded = json.loads(json.dumps(plan.to_json()))
    back = LaunchPlan.from_json(recorded)
    assert [(np.node.name, np.node.host, np.node_rank, np.nproc, np.run_dir) for np in back.nodes] == \
        [(np.node.name, np.node.host, np.node_rank, np.nproc, np.run_dir) for np in plan.nodes]
    assert back.command == ("train.py", "--hf-token", "***")
    assert back.nodes[0].env["HF_TOKEN"] == "***" and back.master_port == plan.master_port
    again = json.loads(json.dumps(back.to_json()))
    for entry in again["nodes"] + recorded["nodes"]:   # a recorded node keeps no env of its own (the plan's has it)
        entry["node"].pop("env"), entry["node"].pop("line")   # nor the hosts.yaml line it came from
    assert again == recorded

    def crafted(change) -> str:
        bad = copy.deepcopy(recorded)
        change(bad)
        with pytest.raises(UsageError) as raised:
            LaunchPlan.from_json(bad, "run X's record")
        return str(raised.value)

    assert "plan.nodes: expected a list of nodes" in crafted(lambda p: p.update(nodes="node0"))
    assert "nodes[1]" in crafted(lambda p: p["nodes"][1].update(nproc=0))
    assert "name" in crafted(lambda p: p["nodes"][0]["node"].update(name="../../.."))
    assert "python" in crafted(lambda p: p["nodes"][0]["node"].update(python="python3\nrm -rf ~"))
    assert "plan.master_port" in crafted(lambda p: p.update(master_port=True))
    assert "plan.command: expected a list of strings" in crafted(lambda p: p.update(command=[1, 2]))
    assert "plan.backend" in crafted(lambda p: p.update(backend="mpi"))
    assert "nodes[0].env" in crafted(lambda p: p["nodes"][0]["env"].update({"A B": "x"}))
