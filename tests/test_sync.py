"""Code sync through the content-addressed store, on a local node."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from nodectl import sync
from nodectl.errors import UsageError
from nodectl.inventory import builtin_inventory
from nodectl.transport import LocalTransport, TransportOptions


@pytest.fixture
def local_node(tmp_path):
    node = builtin_inventory(1).nodes[0]
    return LocalTransport(replace(node, workdir=str(tmp_path / "node")), TransportOptions())


def test_a_file_written_while_it_is_sent_is_refused_by_name(tmp_path, local_node):
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('hi')\n")
    (project / "launch.log").write_text("")
    files = sync.project_files(project)
    (project / "launch.log").write_text("the launch is writing here\n")  # after listing, before sending
    with pytest.raises(UsageError, match=r"launch\.log changed while it was being sent"):
        sync.upload_missing(local_node, files)

    store = Path(local_node.node.workdir) / ".nodectl" / "objects"
    assert not store.exists() or not list(store.iterdir())  # nothing of the refused stream was kept

    listed = sync.project_files(project)  # listed again, it goes, each object under its content's hash
    sent = sync.upload_missing(local_node, listed)
    assert sorted(p.name for p in store.iterdir()) == sorted(f.sha256 for f in listed) and sent > 0
    assert sync.upload_missing(local_node, listed) == 0  # nothing is sent twice


def test_a_sync_stream_cut_midway_leaves_nothing_on_the_node(tmp_path, local_node, monkeypatch):
    project = tmp_path / "project"
    project.mkdir()
    (project / "a.bin").write_bytes(b"a" * (3 << 20))
    (project / "b.bin").write_bytes(b"b" * (3 << 20))
    files = sync.project_files(project)
    store = Path(local_node.node.workdir) / ".nodectl" / "objects"
    sync.upload_missing(local_node, [])  # installs runctl
    original = sync._add_unchanged

    def cut_after_first(tar, file):  # the controller is interrupted after the first object
        if file.path.endswith("b.bin"):
            raise KeyboardInterrupt
        original(tar, file)

    monkeypatch.setattr(sync, "_add_unchanged", cut_after_first)
    with pytest.raises(KeyboardInterrupt):
        sync.upload_missing(local_node, files)
    names = sorted(p.name for p in store.iterdir()) if store.exists() else []
    a = next(f for f in files if f.path.endswith("a.bin"))
    assert names in ([], [a.sha256])  # complete objects only, no temporary or partial file
    assert not list(Path(local_node.node.workdir).rglob("*.tmp")) and not list(Path(local_node.node.workdir).rglob("upload-*"))
