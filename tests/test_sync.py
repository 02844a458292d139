"""Code sync through the content-addressed store, on a local node."""
from __future__ import annotations

import tarfile
from dataclasses import replace

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

    listed = sync.project_files(project)  # listed again, it goes, each object under its content's hash
    remote, sent = sync.upload_missing(local_node, listed)
    with tarfile.open(remote) as tar:
        assert sorted(tar.getnames()) == sorted(f.sha256 for f in listed) and sent > 0
