"""Bringing a run's results home: runctl packs them on the node, the archive is fetched and unpacked here.

The archive comes from a node, and a node may be compromised: `unpack` trusts none of it. Only regular files,
folders and links to a sibling name (output/adapter -> adapter-100) are kept; a name that is absolute, holds
`..` or is over-long is refused; folders are created here, never followed through a link; files are written
without following a link at their own name; links are made last, so nothing is ever written through one. This
does not rely on tarfile's extraction filters (Python 3.11.7's "data" filter lets a crafted archive write outside
the target: CVE-2025-4517).
"""
from __future__ import annotations

import errno
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from nodectl.plan import NodePlan
from nodectl.transport import FanOut, NodeResult, Transport
from nodectl.remote.client import NodeClient

NAME_LIMIT = 1024
UNNAMEABLE = (errno.ENAMETOOLONG, errno.EINVAL, errno.EILSEQ)


@dataclass(frozen=True)
class Collected:
    bytes: int            # the archive's size
    entries: int          # what the node packed
    refused: tuple[str, ...] = ()     # names in the archive that were not unpacked (hostile or unsupported)
    skipped: tuple[str, ...] = ()     # what the node left out: fifos, sockets, devices, links out of the run
    missing: tuple[str, ...] = ()     # --path entries the node did not have
    code_written: int = 0             # files the program wrote under code/, brought back
    code_examples: tuple[str, ...] = ()
    code_left: int = 0                # the synced project's files, left on the node


def collect_node(transport: Transport, run_dir: str, target: Path, also: tuple[str, ...] = ()) -> Collected:
    packed = NodeClient(transport).pack(run_dir, also=also)
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / "collect.tar.gz"
        try:
            transport.get(packed.archive, local, remove=True)   # gone from the node once open for reading
        except BaseException:   # it failed before that: taken away here (SIGKILL: pack's next run replaces it)
            NodeClient(transport).cleanup(packed.archive)
            raise
        refused = unpack(local, target)
    return Collected(packed.bytes, packed.entries, tuple(refused), packed.skipped, packed.missing,
                     packed.code_written, packed.code_examples, packed.code_left)


def share_output(cluster, source: NodePlan, others: list[NodePlan]) -> FanOut[None]:
    """$NODECTL_OUTPUT_DIR, seen by every rank without a shared file system: what `source` (node 0) holds in its
    run's output/ and another node lacks is added there (runctl fill), before a resumed attempt's ranks start.
    The archive passes through this machine, as collect's does; each node keeps every file it wrote itself."""
    run_dirs = {np.node.name: np.run_dir for np in others}
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / "output.tar"
        fetched = cluster.fan_out(lambda t: _fetch_output(t, source.run_dir, local), [source.node])[0]
        if not fetched.ok:
            return FanOut(NodeResult.failed(np.node, f"{source.node.name}'s output could not be read: {fetched.reason}")
                          for np in others)
        size = local.stat().st_size

        def fill(transport: Transport):
            def produce(sink) -> None:
                with open(local, "rb") as handle:
                    sink.send_file(handle, size)
            return NodeClient(transport).fill(run_dirs[transport.node.name], produce)

        return cluster.fan_out(fill, [np.node for np in others])


def _fetch_output(transport: Transport, run_dir: str, local: Path) -> None:
    """The run's output/ on this node, as an uncompressed tar (checkpoints do not compress), at `local`."""
    archive = NodeClient(transport).pack(run_dir, only=("output",)).archive
    try:
        transport.get(archive, local, remove=True)
    except BaseException:
        NodeClient(transport).cleanup(archive)
        raise


def unpack(archive: Path, target: Path) -> list[str]:
    """Extract `archive` under `target` as described above; returns the names refused."""
    target.mkdir(parents=True, exist_ok=True)
    refused, links = [], []
    with tarfile.open(archive, "r:*") as tar:
        for member in tar:
            parts = _safe_parts(member.name)
            if parts is None or not (member.isreg() or member.isdir() or member.issym()):
                refused.append(member.name[:200])
                continue
            try:
                if member.isdir():
                    _folder(target, parts)
                elif member.issym():
                    if _sibling(member.linkname):
                        links.append((parts, member.linkname))
                    else:
                        refused.append(member.name[:200])
                else:
                    _write(tar, member, _folder(target, parts[:-1]) / parts[-1])
            except _Refused:
                refused.append(member.name[:200])
            except OSError as exc:   # a name this file system will not take (300 characters): that entry, not the node
                if exc.errno not in UNNAMEABLE:
                    raise
                refused.append(member.name[:200])
    for parts, link in links:
        try:
            path = _folder(target, parts[:-1]) / parts[-1]
        except _Refused:
            refused.append("/".join(parts))
            continue
        if path.is_symlink():
            path.unlink()
        elif path.exists():
            refused.append("/".join(parts))
            continue
        os.symlink(link, path)
    return refused


class _Refused(Exception):
    pass


def _safe_parts(name: str) -> tuple[str, ...] | None:
    if not name or len(name) > NAME_LIMIT or "\0" in name or name.startswith("/") or "\\" in name:
        return None
    parts = tuple(p for p in PurePosixPath(name).parts if p != ".")
    if not parts or any(p == ".." for p in parts):
        return None
    return parts


def _sibling(link: str) -> bool:
    return bool(link) and "/" not in link and link not in (".", "..") and "\0" not in link


def _folder(target: Path, parts: tuple[str, ...]) -> Path:
    """target/parts, each folder created here (0700) and none of them a link."""
    path = target
    for part in parts:
        path = path / part
        if path.is_symlink():
            raise _Refused(path)
        if not path.exists():
            path.mkdir(mode=0o700)
        elif not path.is_dir():
            raise _Refused(path)
    return path


def _write(tar: tarfile.TarFile, member: tarfile.TarInfo, path: Path) -> None:
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise _Refused(path)
    # under a temporary name, renamed when whole: a full disk or a cut stream leaves no truncated file that reads
    # as the node's (a weights file cut short)
    partial = path.with_name(f".{path.name}.nodectl-partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as out, tar.extractfile(member) as source:
            shutil.copyfileobj(source, out, 1 << 20)
        os.utime(partial, (member.mtime, member.mtime))
        os.replace(partial, path)
    except BaseException:
        try:
            os.unlink(partial)
        except OSError:
            pass
        raise
