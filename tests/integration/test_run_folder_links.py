"""The node-side helper against a run folder whose parts a rank (root in a container, or the user's own program)
replaced with links, on this machine, as runctl runs them on a node: every folder below the workdir is reached a
name at a time (openat with O_NOFOLLOW), so a link in any component is refused, never followed, for reads (tail,
poll, pack) and writes (state, fill, prepare, the launcher's log); a workdir reached through another user's link is
refused like OpenSSH's StrictModes would; a resume given up before it started never deletes an earlier attempt."""
from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tarfile

import pytest

from nodectl.resources import resource_dir
from support.sshcluster import ensure_user

sys.path.insert(0, str(resource_dir("launchers")))
import nodeio  # noqa: E402
import runctl  # noqa: E402
import runlayout  # noqa: E402
from runctl.common import Unsafe, resolve_workdir, trusted_run_dir  # noqa: E402

RUN_ID = "20260101-000000-abcd"
SECRET = "the victim's private line\n"


@pytest.fixture
def run_dir(tmp_path):
    """<workdir>/runs/<id>, laid out as `prepare` lays it, by its real path (as dispatch hands it over)."""
    folder = tmp_path / "work" / "runs" / RUN_ID
    for name in runlayout.FOLDERS:
        (folder / name).mkdir(parents=True, exist_ok=True)
    (folder / "node.json").write_text(json.dumps({"run_id": RUN_ID, "node_rank": 0, "ranks": [0, 1]}))
    return folder


@pytest.fixture
def victim(tmp_path):
    """Another party's private folder and file, which nothing of the run may read or write."""
    folder = tmp_path / "victim"
    folder.mkdir(mode=0o700)
    (folder / "private.txt").write_text(SECRET)
    os.chmod(folder / "private.txt", 0o600)
    return folder


def swap_for_link(path, target) -> None:
    """What root in the container did: the folder moved aside, a link in its place."""
    shutil.rmtree(path)
    os.symlink(target, path)


def test_a_logs_folder_swapped_for_a_link_is_never_read_nor_written(run_dir, victim):
    (victim / "rank1.log").write_text(SECRET)
    swap_for_link(run_dir / "logs", victim)
    tail = runctl.watch.cmd_tail([str(run_dir)], {"ranks": [1, "launcher"], "lines": 20})["logs"]
    assert tail["1"]["text"] == "" and SECRET not in json.dumps(tail)
    poll = runctl.watch.cmd_poll([str(run_dir)], {"offsets": {"1": 0}})
    assert SECRET not in json.dumps(poll) and poll["ranks"][1]["log_size"] == 0
    with pytest.raises(nodeio.LinkRefused, match="logs is a symbolic link"):
        nodeio.open_nofollow(str(run_dir / runlayout.LAUNCHER_LOG), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    assert sorted(os.listdir(victim)) == ["private.txt", "rank1.log"], "no launcher.log written through the link"
    packed = runctl.collect.cmd_pack([str(run_dir)], {})
    with tarfile.open(packed["archive"]) as archive:
        names = archive.getnames()
        assert not any(n.startswith("logs/") and n != "logs" for n in names), names
        assert all(SECRET.encode() not in archive.extractfile(m).read() for m in archive.getmembers() if m.isfile())
    assert "logs" in packed["skipped"]


def test_state_swapped_for_a_link_gets_no_host_write(run_dir, victim):
    swap_for_link(run_dir / "state", victim)
    with pytest.raises(nodeio.LinkRefused, match="state is a symbolic link"):
        runctl.common.write_file(str(run_dir / runlayout.STOPPED), "{}")
    assert sorted(os.listdir(victim)) == ["private.txt"]
    assert runctl.watch.cmd_poll([str(run_dir)], {})["started"] is False   # a pgid behind the link is not read


def test_fill_never_writes_through_a_linked_folder_and_a_long_name_is_one_refused_entry(run_dir, victim):
    """`launch --resume` fills node 0's output/ in: a folder of output/ that is a link (to /root/.ssh, say) is
    refused; a name the file system refuses is one refused entry; everything else still lands."""
    os.symlink(victim, run_dir / "output" / "ckpt")
    stream = io.BytesIO()
    with tarfile.open(fileobj=stream, mode="w") as tar:
        for name, data in (("output/ckpt/authorized_keys", b"ssh-ed25519 AAAA attacker\n"),
                           ("output/" + "x" * 300, b"long"), ("output/adapter/weights.bin", b"w" * 10)):
            member = tarfile.TarInfo(name)
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    answer = _fill(run_dir, stream.getvalue())
    assert sorted(os.listdir(victim)) == ["private.txt"], "nothing written through the link"
    assert answer["added"] == 1 and (run_dir / "output" / "adapter" / "weights.bin").read_bytes() == b"w" * 10
    refused = " ".join(answer["refused"])
    assert "output/ckpt/authorized_keys" in refused and "x" * 190 + " (File name too long)" in refused, answer
    swap_for_link(run_dir / "output", victim)
    with pytest.raises(nodeio.LinkRefused, match="output is a symbolic link"):
        _fill(run_dir, stream.getvalue())


def _fill(run_dir, data: bytes) -> dict:
    saved = sys.stdin
    sys.stdin = io.TextIOWrapper(io.BytesIO(data))
    try:
        return runctl.collect.cmd_fill([str(run_dir)], {})
    finally:
        sys.stdin = saved


def test_a_resume_given_up_before_it_started_keeps_every_earlier_attempt(run_dir):
    """The clean-up of a launch that never started removes a folder only when no attempt ever ran in it: a
    resumed run's folder (attempts/, checkpoints in output/) stays byte for byte, whatever stopped the resume."""
    (run_dir / "output" / "ckpt-100.pt").write_bytes(b"weights at step 100")
    (run_dir / "attempts" / "0" / "logs").mkdir(parents=True)
    answer = runctl.stop.cmd_stop([str(run_dir)], {"grace": 1, "unstarted": True})
    assert answer.get("kept") and not answer.get("removed")
    assert (run_dir / "output" / "ckpt-100.pt").read_bytes() == b"weights at step 100"
    assert (run_dir / "attempts" / "0" / "logs").is_dir()
    fresh = run_dir.parent / "20260101-000001-beef"   # a first attempt prepared and given up: nothing to keep
    for name in runlayout.FOLDERS:
        (fresh / name).mkdir(parents=True)
    (fresh / "node.json").write_text(json.dumps({"run_id": fresh.name, "node_rank": 0, "ranks": [0]}))
    assert runctl.stop.cmd_stop([str(fresh)], {"grace": 1, "unstarted": True})["removed"]
    assert not fresh.exists()


def test_preparing_a_resumed_attempt_leaves_no_temporary_copies_in_code(run_dir, tmp_path):
    """The resumed attempt places the same store objects over the earlier attempt's hard links: a rename between
    two links to one file does nothing, and left `<name>.<pid>.tmp` beside every project file."""
    store = tmp_path / "work" / ".nodectl" / "objects"
    store.mkdir(parents=True)
    (store / ("a" * 64)).write_bytes(b"print('train')\n")
    os.chmod(store / ("a" * 64), 0o600)
    request = {"workdir": str(tmp_path / "work"), "run_dir": str(run_dir), "rendered": {},
               "files": [{"path": "code/train.py", "sha256": "a" * 64, "mode": 0o644},
                         {"path": "code/pkg/mod.py", "sha256": "a" * 64, "mode": 0o644}]}
    runctl.runfolder.cmd_prepare([], request)
    runctl.runfolder.cmd_prepare([], dict(request, new_attempt=True))
    assert sorted(p.relative_to(run_dir / "code").as_posix() for p in (run_dir / "code").rglob("*")) == \
        ["pkg", "pkg/mod.py", "train.py"]
    packed = runctl.collect.cmd_pack([str(run_dir)], {})
    assert packed["code_written"] == 0 and packed["skipped"] == [], packed


def test_a_code_folder_swapped_for_a_link_is_never_prepared_through(run_dir, victim, tmp_path):
    store = tmp_path / "work" / ".nodectl" / "objects"
    store.mkdir(parents=True)
    (store / ("b" * 64)).write_bytes(b"x")
    os.symlink(victim, run_dir / "code" / "pkg")
    with pytest.raises(nodeio.LinkRefused, match="pkg is a symbolic link"):
        runctl.runfolder.cmd_prepare([], {"workdir": str(tmp_path / "work"), "run_dir": str(run_dir),
                                          "rendered": {}, "new_attempt": True,
                                          "files": [{"path": "code/pkg/authorized_keys", "sha256": "b" * 64}]})
    assert sorted(os.listdir(victim)) == ["private.txt"]


def test_the_listeners_fifos_of_earlier_attempts_are_not_reported_as_left_out(run_dir):
    for flight in (run_dir / "flight", run_dir / "attempts" / "0" / "flight"):
        flight.mkdir(parents=True, exist_ok=True)
        os.mkfifo(flight / "rank0.request")
    (run_dir / "attempts" / "0" / "flight" / "rank0.answer.json").write_text("{}")
    packed = runctl.collect.cmd_pack([str(run_dir)], {})
    assert packed["skipped"] == [], packed


def test_a_workdir_through_another_users_link_in_a_sticky_folder_is_refused(tmp_path):
    """`ln -s /etc /srv/shared/rootwd` by another user: judged like OpenSSH's StrictModes, the link (its owner,
    the folder it sits in) is named with the fix, and nothing is made where it points."""
    mallory = ensure_user("nodectl-mallory", "/bin/sh")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    target = tmp_path / "etc-like"
    target.mkdir()
    os.symlink(target, shared / "rootwd")
    os.lchown(shared / "rootwd", mallory.pw_uid, mallory.pw_gid)
    with pytest.raises(Unsafe) as refused:
        trusted_run_dir(str(shared / "rootwd" / "runs" / RUN_ID), create=True)
    said = str(refused.value)
    assert f"{shared}/rootwd" in said and "symbolic link" in said and "nodectl-mallory" in said
    assert "other users can write" in said and "mkdir -m 700" in said
    assert os.listdir(target) == []
    os.lchown(shared / "rootwd", 0, 0)   # the same link made by root (or you) is followed, to its real path
    assert resolve_workdir(str(shared / "rootwd")) == str(target)
    assert trusted_run_dir(str(shared / "rootwd" / "runs" / RUN_ID), create=True) == str(target / "runs" / RUN_ID)


def test_a_listeners_answer_is_packed_with_its_quoted_source_lines_masked(run_dir):
    """Round four: collect brought home flight/rank<R>.answer.json with the program's source line holding a token
    as it stood. Packed now, every string in it goes through the secret rules; the place (file, line) is kept. A
    rank may write anything there: one that is not JSON is masked as text."""
    token = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz012345"
    answer = {"ids": ["r1"], "threads": [{"name": "MainThread", "frames": [
        {"file": "train.py", "line": 13, "source": f"hub = HfApi(token='{token}')"},
        {"file": "train.py", "line": 20, "source": "url = 'http://minio:9000/?X-Amz-Signature=f00dsig4242'"}]}]}
    for flight in (run_dir / "flight", run_dir / "attempts" / "0" / "flight"):
        flight.mkdir(parents=True, exist_ok=True)
    (run_dir / "flight" / "rank0.answer.json").write_text(json.dumps(answer))
    (run_dir / "attempts" / "0" / "flight" / "rank1.answer.json").write_text(f"not json {token}")
    packed = runctl.collect.cmd_pack([str(run_dir)], {})
    assert packed["skipped"] == [], packed
    with tarfile.open(packed["archive"]) as tar:
        brought = {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}
    kept = json.loads(brought["flight/rank0.answer.json"])
    lines = [f["source"] for f in kept["threads"][0]["frames"]]
    assert token not in brought["flight/rank0.answer.json"] and "f00dsig4242" not in lines[1]
    assert lines[0].startswith("hub = HfApi(token=") and "***" in lines[0] and kept["threads"][0]["frames"][0]["line"] == 13
    assert token not in brought["attempts/0/flight/rank1.answer.json"]
    assert brought["attempts/0/flight/rank1.answer.json"].startswith("not json")
