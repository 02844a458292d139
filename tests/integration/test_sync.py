"""Code sync through the content-addressed store, on a local node."""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from nodectl.remote import sync
from nodectl.errors import UsageError
from nodectl.inventory import builtin_inventory
from nodectl.transport import LocalTransport, TransportOptions


@pytest.fixture
def local_node(tmp_path):
    node = builtin_inventory(1).nodes[0]
    return LocalTransport(replace(node, workdir=str(tmp_path / "node")), TransportOptions())


def test_a_file_written_while_it_is_sent_goes_as_the_snapshot_that_was_hashed(tmp_path, local_node):
    """A log or output being written inside the project (nohup.out, `| tee run.log`) no longer fails a launch:
    a recently written file is copied while it is hashed, and that copy is what travels."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('hi')\n")
    (project / "launch.log").write_text("first line\n")
    files = sync.project_files(project)
    with open(project / "launch.log", "a") as log:   # after listing, before and while sending
        log.write("the launch is writing here\n" * 1000)
    sent = sync.upload_missing(local_node, files)
    store = Path(local_node.node.workdir) / ".nodectl" / "objects"
    assert sorted(p.name for p in store.iterdir()) == sorted(f.sha256 for f in files) and sent > 0
    log = next(f for f in files if f.path == "code/launch.log")
    assert (store / log.sha256).read_text() == "first line\n"
    assert sync.upload_missing(local_node, files) == 0  # nothing is sent twice


def test_an_old_file_changed_during_the_send_is_refused_by_name(tmp_path, local_node):
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('hi')\n")
    (project / "data.txt").write_text("")
    os.utime(project / "data.txt", (1_600_000_000, 1_600_000_000))   # untouched for years: sent in place
    files = sync.project_files(project)
    (project / "data.txt").write_text("rewritten meanwhile\n")
    with pytest.raises(UsageError, match=r"data\.txt changed while it was being sent"):
        sync.upload_missing(local_node, files)
    store = Path(local_node.node.workdir) / ".nodectl" / "objects"
    assert not store.exists() or not list(store.iterdir())  # nothing of the refused stream was kept


def test_editor_swap_files_and_nodectls_own_output_are_not_sent(tmp_path, monkeypatch):
    project = tmp_path / "project"
    project.mkdir()
    for name in ("train.py", ".train.py.swp", "train.py~", ".#train.py", "launch.log"):
        (project / name).write_text("x\n")
    with open(project / "launch.log", "a") as log:
        monkeypatch.setattr(sync, "_own_output", lambda: {(os.fstat(log.fileno()).st_dev,
                                                           os.fstat(log.fileno()).st_ino)})
        names = sorted(f.path for f in sync.project_files(project))
    assert names == ["code/train.py"]


def test_a_sync_stream_cut_midway_leaves_nothing_on_the_node(tmp_path, local_node, monkeypatch):
    project = tmp_path / "project"
    project.mkdir()
    (project / "a.bin").write_bytes(b"a" * (3 << 20))
    (project / "b.bin").write_bytes(b"b" * (3 << 20))
    files = sync.project_files(project)
    store = Path(local_node.node.workdir) / ".nodectl" / "objects"
    sync.upload_missing(local_node, [])  # installs runctl
    original = sync._add_unchanged

    def cut_after_first(sink, file):  # the controller is interrupted after the first object
        if file.path.endswith("b.bin"):
            raise KeyboardInterrupt
        return original(sink, file)

    monkeypatch.setattr(sync, "_add_unchanged", cut_after_first)
    with pytest.raises(KeyboardInterrupt):
        sync.upload_missing(local_node, files)
    names = sorted(p.name for p in store.iterdir()) if store.exists() else []
    a = next(f for f in files if f.path.endswith("a.bin"))
    assert names in ([], [a.sha256])  # complete objects only, no temporary or partial file
    assert not list(Path(local_node.node.workdir).rglob("*.tmp")) and not list(Path(local_node.node.workdir).rglob("upload-*"))


class _Counting(LocalTransport):
    """A local node that records each command nodectl sends it (over SSH each is a session, a shell and a
    Python start on the node)."""

    def __init__(self, node, options) -> None:
        super().__init__(node, options)
        self.commands: list[str] = []

    def run(self, argv, **kwargs):
        self.commands.append("run")
        return super().run(argv, **kwargs)

    def run_stream(self, argv, produce, **kwargs):
        self.commands.append("stream")
        return super().run_stream(argv, produce, **kwargs)


def _two_local_nodes(tmp_path, project):
    from nodectl.plan import build_plan
    from nodectl.render import render_plan

    inventory = builtin_inventory(2)
    inventory = replace(inventory, nodes=tuple(replace(n, workdir=str(tmp_path / n.name)) for n in inventory.nodes))
    plan = build_plan(inventory, gpus=None, command=("train.py",), sync_dir=str(project))
    return inventory, plan, render_plan(plan)


def _prepare_everywhere(inventory, plan, rendered, files):
    """What a launch does before it starts anything: survey, then each node's code and run folder."""
    import threading

    from nodectl.launch.nodes import prepare_node, survey
    from nodectl.transport import Cluster

    with Cluster(inventory.nodes) as cluster:
        cluster.transports = {name: _Counting(t.node, t.options) for name, t in cluster.transports.items()}
        surveyed = survey(plan, cluster, files)
        sent = [prepare_node(cluster.transports[np.node.name], plan, np, rendered[i], files, threading.Event(),
                             surveyed.missing[np.node.name]) for i, np in enumerate(plan.nodes)]
        return {name: t.commands for name, t in cluster.transports.items()}, sent


def test_a_fresh_node_gets_runctl_its_code_and_its_run_folder_in_two_commands(tmp_path):
    """Each command is a round trip with a session and a Python start on the node: at 32 nodes sharing one
    controller they were a third of the sync. A fresh node took six before its start (runctl missing, install,
    identity, have, receive, prepare); now the first call installs runctl on its way and the stream lays out
    the run folder. A node that has everything gets its run folder in two commands and is sent nothing."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('hi')\n")
    (project / "data.bin").write_bytes(os.urandom(1 << 20))
    inventory, plan, rendered = _two_local_nodes(tmp_path, project)
    files = sync.project_files(project) + sync.nodectl_files(False, None)

    commands, sent = _prepare_everywhere(inventory, plan, rendered, files)
    assert commands == {"local0": ["run", "stream"], "local1": ["run", "stream"]}
    assert all(count == len(files) and size > (1 << 20) for count, size in sent)
    for node_plan in plan.nodes:
        run_dir = Path(node_plan.run_dir)
        assert (run_dir / "code" / "data.bin").read_bytes() == (project / "data.bin").read_bytes()
        assert (run_dir / "launch.sh").is_file() and (run_dir / "lib" / "rankexec.py").is_file()

    commands, sent = _prepare_everywhere(inventory, replace(plan, run_id=plan.run_id + "x"), rendered, files)
    assert commands == {"local0": ["run", "run"], "local1": ["run", "run"]} and [s for _, s in sent] == [0, 0]


def test_a_node_whose_runctl_vanished_after_the_first_call_gets_it_again(tmp_path):
    from nodectl.remote import agent

    transport = _Counting(replace(builtin_inventory(1).nodes[0], workdir=str(tmp_path / "node")), TransportOptions())
    first = agent.call(transport, "identity", transport.node.workdir)
    installed = Path(agent.agent_path(transport.node.workdir))
    assert installed.is_file() and oct(installed.parent.stat().st_mode & 0o777) == "0o700"
    installed.unlink()  # a workdir on a tmpfs that a reboot emptied
    assert agent.call(transport, "identity", transport.node.workdir) == first
    assert transport.commands == ["run", "run", "run", "run"] and installed.is_file()  # call, missing, install, call


def test_file_contents_move_in_the_kernel_and_without_sendfile_they_still_arrive(tmp_path, local_node, monkeypatch):
    """The stream hands file contents from the page cache to the ssh client's pipe with sendfile, so no byte of
    a 200 MB project passes through Python (memory and CPU of the controller do not grow with the node count x
    project). A file system that refuses sendfile falls back to reads; both deliver the same objects."""
    import errno

    project = tmp_path / "project"
    project.mkdir()
    (project / "weights.bin").write_bytes(os.urandom(5 << 20) + b"tail")
    (project / "small.txt").write_text("x" * 100)
    files = sync.project_files(project)
    moved = []
    real_sendfile = os.sendfile

    def counting(out_fd, in_fd, offset, count):
        done = real_sendfile(out_fd, in_fd, offset, count)
        moved.append(done)
        return done

    monkeypatch.setattr(os, "sendfile", counting)
    sync.upload_missing(local_node, files)
    assert sum(moved) == sum(f.size for f in files)
    store = Path(local_node.node.workdir) / ".nodectl" / "objects"
    assert sorted(p.name for p in store.iterdir()) == sorted(f.sha256 for f in files)

    def refusing(*args):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "sendfile", refusing)
    other = replace(local_node.node, workdir=str(tmp_path / "other"))
    sync.upload_missing(LocalTransport(other, TransportOptions()), files)
    again = Path(other.workdir) / ".nodectl" / "objects"
    assert {p.name: p.read_bytes() for p in again.iterdir()} == {p.name: p.read_bytes() for p in store.iterdir()}
