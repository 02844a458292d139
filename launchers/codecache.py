"""runctl's compiled code, kept beside its artifact on the node: the artifact's __main__ runs through this.

Python imports a zip's modules from their source every time (zipimport writes no bytecode), so every call of
runctl compiled all of it again: about 0.15 CPU s a call, four times what the call itself costs, and a launch
makes several calls per node. Here the first call compiles every module of the artifact once, with this node's
Python, and writes the code objects into one file next to the artifact, `<artifact>.<cache tag>-<build>.codes`
(mode 0600, swapped in whole). Later calls import from it.

The file is trusted as the artifact is (VERIFIED in nodectl/remote/agent.py): a regular file of the login user's,
writable by nobody else, in the folder VERIFIED has already checked (the user's own, 0700). It names the sha256 of
the artifact it was compiled from and this Python build (its whole version string): a file compiled from other
bytes or by another Python is not used, and is compiled again. Whatever goes wrong here (a full disk, a read-only folder) costs only
the cache: the call imports from the zip as before. Standard library only, as runctl.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import marshal
import os
import stat
import sys

FORMAT = b"nodectl-codes 2\n"


class _Finder:
    """Serves the artifact's modules from compiled code objects, ahead of the zip on sys.meta_path."""

    def __init__(self, artifact: str, index: dict, blobs: bytes) -> None:
        self.artifact, self.index, self.blobs = artifact, index, blobs

    def find_spec(self, name, path=None, target=None):
        entry = self.index.get(name)
        if entry is None:
            return None
        is_package = entry[0]
        where = os.path.join(self.artifact, *name.split("."))
        origin = os.path.join(where, "__init__.py") if is_package else where + ".py"
        spec = importlib.machinery.ModuleSpec(name, self, origin=origin, is_package=is_package)
        spec.has_location = True
        if is_package:
            spec.submodule_search_locations = [where]
        return spec

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        _, start, end = self.index[module.__spec__.name]
        exec(marshal.loads(self.blobs[start:end]), module.__dict__)   # only the modules this call imports


def _compile_all(artifact: str, data: bytes) -> tuple[dict, bytes]:
    """Every module of the artifact but its __main__, compiled: an index {module name: (is a package, start, end)}
    into the code objects, each marshalled on its own."""
    import io
    import zipfile

    index, blobs = {}, io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        for name in archive.namelist():
            if not name.endswith(".py") or name == "__main__.py":
                continue
            parts = name[:-3].split("/")
            is_package = parts[-1] == "__init__"
            code = compile(archive.read(name), os.path.join(artifact, name), "exec", dont_inherit=True)
            start = blobs.tell()
            blobs.write(marshal.dumps(code))
            index[".".join(parts[:-1] if is_package else parts)] = (is_package, start, blobs.tell())
    return index, blobs.getvalue()


def _header(data: bytes) -> bytes:
    """The format, the Python that compiled (its whole version string: another build compiles again) and the
    artifact's sha256."""
    return FORMAT + sys.version.encode() + b"\n" + hashlib.sha256(data).digest()


def _read(path: str, header: bytes):
    """The code objects kept at `path`, or None where there is no such file or it is not to be trusted or used."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
            return None
        with os.fdopen(os.dup(fd), "rb") as handle:
            if handle.read(len(header)) != header:
                return None
            index = marshal.load(handle)
            blobs = handle.read()
        return (index, blobs) if isinstance(index, dict) else None
    except (OSError, EOFError, ValueError, TypeError):
        return None
    finally:
        os.close(fd)


def _write(path: str, header: bytes, index: dict, blobs: bytes) -> None:
    temporary = "%s.tmp%d" % (path, os.getpid())
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(header)
            marshal.dump(index, handle)
            handle.write(blobs)
        os.replace(temporary, path)
    except (OSError, ValueError):
        try:
            os.unlink(temporary)
        except OSError:
            pass


def install(artifact: str) -> None:
    """Import the artifact's modules from the code kept beside it (compiled and kept first, where there is none)."""
    try:
        with open(artifact, "rb") as handle:
            data = handle.read()
    except OSError:
        return
    header = _header(data)
    # one file per Python build: two interpreters of one workdir never take turns rewriting each other's
    path = "%s.%s-%s.codes" % (artifact, sys.implementation.cache_tag or "python",
                               hashlib.sha256(sys.version.encode()).hexdigest()[:8])
    kept = _read(path, header)
    if kept is None:
        try:
            kept = _compile_all(artifact, data)
        except Exception:   # noqa: BLE001 - a zip that will not compile here: the zip's own import says why
            return
        _write(path, header, *kept)
    sys.meta_path.insert(0, _Finder(artifact, *kept))
