"""Reading and writing on the node's side, once: a helper's answer is one JSON object, its last line that is one (a
login banner or a log line may come before it), and a file is written whole under a new name, then renamed. Shipped
inside runctl's artifact and synced into lib/ beside runlayout.py; the controller imports the reader
(nodectl.resources.launchers.nodeio). Standard library only."""
from __future__ import annotations

import errno
import json
import os
import stat


def last_json(text: str):
    """The last line that is a JSON object, or None."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except (ValueError, RecursionError):   # an answer nested too deep is no answer
                continue
            if isinstance(value, dict):
                return value
    return None


def write_file(path: str, text: str, mode: int = 0o644, strict: bool = False) -> None:
    """Written whole under a new name, then renamed over `path` (a link planted at either name is replaced, never
    written through). `strict` (runctl, acting on a run folder by its real path): the folder is reached from / a
    name at a time, so a link in any component (a `state/` or `logs/` a rank replaced) is refused, not followed."""
    folder, name = os.path.split(path)
    parent = walk(folder) if strict else None
    tmp = f"{name if strict else path}.tmp{os.getpid()}.{os.urandom(4).hex()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=parent)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            os.fchmod(handle.fileno(), mode)
        os.replace(tmp, name if strict else path, src_dir_fd=parent, dst_dir_fd=parent)
    finally:
        if parent is not None:
            os.close(parent)


def update_json(path: str, entries: dict) -> None:
    """A JSON mapping at the real `path` (nothing reached through a link) with `entries` added, written whole."""
    try:
        fd = open_nofollow(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, encoding="utf-8") as handle:
            current = json.load(handle)
    except (OSError, ValueError, RecursionError):
        current = {}
    current = current if isinstance(current, dict) else {}
    write_file(path, json.dumps({**current, **entries}), 0o600, strict=True)


# Reaching a run folder's files on the host. A rank (root in a container, or the user's own program) may replace
# any folder it can write with a link; a path string would be followed through it. So a path is walked from / a
# name at a time, each folder opened with O_NOFOLLOW | O_DIRECTORY and each step relative to the last descriptor
# (openat): a link in any component is refused with its name. Callers pass real paths (runctl resolves the run
# folder once, under the workdir rule).
class LinkRefused(OSError):
    """A component of a path is a link, or not a folder: never followed."""


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _refusal(prefix: str, name: str, exc: OSError) -> OSError:
    where = f"{prefix.rstrip('/')}/{name}"
    if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
        return exc
    try:
        target = os.readlink(where)
    except OSError:
        return LinkRefused(errno.ENOTDIR, f"{where} is not a folder")
    return LinkRefused(errno.ELOOP, f"{where} is a symbolic link (to {target}): not followed")


def walk(path: str, create: bool = False, mode: int = 0o700) -> int:
    """A descriptor of the folder at the absolute `path`, reached without following any link; missing folders made
    (`mode`) with `create`. The caller closes it."""
    if not path.startswith("/"):
        raise ValueError(f"{path!r} is not an absolute path")
    fd, prefix = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), ""
    try:
        for name in (part for part in path.split("/") if part not in ("", ".")):
            if name == "..":
                raise LinkRefused(errno.EINVAL, f"{path} has '..' in it")
            try:
                next_fd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(name, mode, dir_fd=fd)
                except FileExistsError:
                    pass
                next_fd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise _refusal(prefix or "/", name, exc) from None
            os.close(fd)
            fd, prefix = next_fd, f"{prefix}/{name}"
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_nofollow(path: str, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """A descriptor of the file at the absolute `path`, no component of it a link (the last one included)."""
    folder, name = os.path.split(path)
    parent = walk(folder)
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=parent)
    except OSError as exc:
        raise _refusal(folder, name, exc) from None
    finally:
        os.close(parent)


def lstat_nofollow(path: str):
    """os.lstat of `path`, reached without following a link in any folder above it; None when it is not there
    (or a folder above it is a link)."""
    folder, name = os.path.split(path)
    try:
        parent = walk(folder)
    except OSError:
        return None
    try:
        return os.stat(name, dir_fd=parent, follow_symlinks=False)
    except OSError:
        return None
    finally:
        os.close(parent)


def listdir_nofollow(path: str) -> list:
    """The names in the folder at `path`, reached without a link; [] when it is not there or is refused."""
    try:
        fd = walk(path)
    except OSError:
        return []
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)


def is_file(path: str) -> bool:
    """A regular file at `path`, reached without a link."""
    info = lstat_nofollow(path)
    return info is not None and stat.S_ISREG(info.st_mode)
