"""`environment:` in hosts.yaml (or `launch --environment FILE`): one locked venv per node, built by nodectl.

The file (a requirements.txt or a pinned lock, inside the synced project) is resolved once here, on the controller,
by pip's resolver (`pip download`: it honours the controller's pip configuration, indexes and find-links), for the
nodes' interpreter and platform, which may differ from the controller's; the wheels land in a cache
(~/.cache/nodectl/wheels/<key>) and reach the nodes through the content-addressed object store, so a wheel a node
has is never sent again. Each node then builds the venv offline, in parallel with the others, with uv (its wheel
is fetched and sent the same way) or with the interpreter's own venv and pip where no uv wheel fits, under
<workdir>/.nodectl/envs/<key>, the key being the file's hash with the node's Python and platform. A later launch
with the same file reuses it; a changed file is a new key, built beside the old one. The venv's manifest catches
any file changed, added or removed since the build: that venv is set aside and built again (launch), or reported
(preflight). `install: index` has each node install from its own package index instead (online nodes).

uv resolves faster than pip, but has no `download` command (astral-sh/uv#3163) and does not read pip's
configuration, so fetching stays with pip; on the nodes, where the time goes, uv installs. The nodes' side is
driven by nodectl/remote/envs.py.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from nodectl.errors import NodectlError, UsageError
from nodectl.secrets import mask_url, url_secret
from nodectl.sections import section

KEYS = {"file", "install", "index_url"}
INSTALLS = ("wheels", "index")
BUILD_TIMEOUT = 3600.0
FETCH_TIMEOUT = 3600.0


@dataclass(frozen=True)
class Environment:
    file: str                      # inside the synced project
    install: str = "wheels"        # wheels: fetched here and sent; index: each node installs from its own index
    index_url: str | None = None   # install: index, an index other than the node's pip default
    lock_sha: str | None = None    # the file's sha256, once read (bind_locks)
    requirements: str | None = None


def parse(value: Any, label: str, fail: Callable[[str, str], None]) -> Environment | None:
    value = section(value, label, fail, shorthand="file", keys=KEYS, shape="a requirements file or lock inside the "
                    "synced project (environment: requirements.txt), or a mapping with file: and install: (wheels | "
                    "index)")
    if value is None:
        return None
    file = value.get("file")
    if not isinstance(file, str) or not file.strip() or "\0" in file or "\n" in file:
        fail(f"{label}.file", f"a path inside the synced project, got {file!r}")
    if os.path.isabs(file) or ".." in Path(file).parts:
        fail(f"{label}.file", f"a path inside the synced project (relative, no ..), got {file!r}")
    install = value.get("install", "wheels")
    if install not in INSTALLS:
        fail(f"{label}.install", f"one of {', '.join(INSTALLS)}, got {install!r}")
    index_url = value.get("index_url")
    if index_url is not None and (not isinstance(index_url, str) or "://" not in index_url):
        fail(f"{label}.index_url", f"an index URL (https://...), got {mask_url(str(index_url))!r}")
    if index_url is not None and (secret := url_secret(index_url)):
        fail(f"{label}.index_url", f"an index URL without {secret}, got {mask_url(index_url)!r}: it would reach "
             f"records and command lines; give the index's credentials to pip on the node (its pip.conf, ~/.netrc or "
             f"keyring)")
    return Environment(file=file, install=install, index_url=index_url)


def bind_locks(inventory, project: str | os.PathLike):
    """The inventory with each environment's file read from the project (its hash decides the venv's key)."""
    read: dict[str, tuple[str, str]] = {}
    nodes = []
    for node in inventory.nodes:
        env = node.environment
        if env is not None:
            if env.file not in read:
                read[env.file] = _read(Path(project), env.file)
                check_requirements(read[env.file][0], env.file)
            text, sha = read[env.file]
            if env.install == "index":   # what the node resolves depends on where it resolves
                sha = hashlib.sha256(f"{sha}|index|{env.index_url}".encode()).hexdigest()
            node = replace(node, environment=replace(env, lock_sha=sha, requirements=text))
        nodes.append(node)
    return replace(inventory, nodes=tuple(nodes))


def with_environment(inventory, file: str):
    """`launch --environment FILE`: every node gets it (a container: setting is refused beside it)."""
    env = parse(file, "--environment", _refuse_option)
    clash = [n.name for n in inventory.nodes if n.container is not None]
    if clash:
        raise UsageError(f"--environment: {', '.join(clash)} run in a container (container: in the inventory); an "
                         f"image brings its own environment")
    return replace(inventory, nodes=tuple(replace(n, environment=env) for n in inventory.nodes))


def _refuse_option(key: str, expected: str) -> None:
    raise UsageError(f"{key}: {expected}")


def _read(project: Path, name: str) -> tuple[str, str]:
    """The file's text and sha256, read inside the project only: a link out of it (to ~/.ssh/id_ed25519, say)
    is refused without a word of what it points at being read or shown."""
    path = project / name
    root = project.resolve()
    if path.exists() and not path.resolve().is_relative_to(root):
        raise UsageError(f"environment: {name} is a link out of the project ({root}); only files inside it are "
                         f"read: copy the requirements into the project")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"environment: {name} is not in the project ({path.parent}); give a requirements file or "
                         f"lock inside it") from None
    except OSError as exc:
        raise UsageError(f"environment: {name} cannot be read ({exc.strerror or exc})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"environment: {name} is not UTF-8 text") from None
    return text, hashlib.sha256(data).hexdigest()


# What a requirements line may not be: each runs or reads something that is not a wheel from an index (a local
# folder's setup.py ran on the controller as root, twice, despite --only-binary; `pkg @ URL` to an sdist is the same).
REFUSED_OPTIONS = ("-e", "--editable", "-r", "--requirement", "-c", "--constraint", "-f", "--find-links", "-i",
                   "--index-url", "--extra-index-url", "--trusted-host", "--no-binary")


# a requirement "named" like a file is one to pip: a local archive, built (an sdist's setup.py) or installed
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".tbz", ".tar.xz", ".txz", ".tar", ".zip", ".whl", ".egg")


def check_requirements(text: str, name: str) -> None:
    """Every line of an environment file is a named requirement from an index (a pinned lock's `--hash` options
    beside it are fine): direct references (`pkg @ URL`, `git+...`), URLs, local paths, editable installs and
    other files or indexes are refused by name, on the controller, before anything is resolved or built.
    Indexes belong in `index_url:`, where their credentials stay out of files and command lines."""
    from packaging.requirements import InvalidRequirement, Requirement

    logical = text.replace("\\\n", " ").splitlines()
    for number, line in enumerate(logical, 1):
        body = line.split(" #", 1)[0].strip() if not line.lstrip().startswith("#") else ""
        if not body:
            continue
        words = body.split()
        if words[0].split("=", 1)[0] in REFUSED_OPTIONS:
            raise UsageError(f"environment: {name} line {number}: {words[0].split('=', 1)[0]} is refused: an "
                             f"environment is wheels from an index (set the index with index_url: in hosts.yaml)")
        requirement_text = " ".join(w for w in words if not w.startswith("--hash"))
        if words[0].startswith("-"):
            raise UsageError(f"environment: {name} line {number}: the option {words[0]} is not taken; give "
                             f"requirements only (name, version, markers, --hash)")
        try:
            requirement = Requirement(requirement_text)
        except InvalidRequirement:
            raise UsageError(f"environment: {name} line {number}: {words[0][:80]!r} is not a requirement by name (a "
                             f"local path or URL is refused: its setup.py would run here; publish a wheel to an "
                             f"index)") from None
        if requirement.name.lower().endswith(ARCHIVE_SUFFIXES):
            raise UsageError(f"environment: {name} line {number}: {requirement.name[:80]!r} names an archive file, "
                             f"refused (pip reads it as a local path, an sdist whose setup.py would run here); name "
                             f"the package and a version on an index instead")
        if requirement.url:
            raise UsageError(f"environment: {name} line {number}: {requirement.name} @ ... is a direct reference, "
                             f"refused (a URL or path can hold an sdist whose setup.py runs here); name a version "
                             f"on an index instead")


# --- the controller's side: resolve and fetch once per lock and platform ---------------------------------------

def cache_root() -> Path:
    return Path(os.environ.get("NODECTL_CACHE") or Path.home() / ".cache" / "nodectl")


def pip_platforms(machine: str, libc: str, libc_version: str) -> list[str]:
    """The wheel platform tags a node of this machine and C library installs: manylinux_2_X down to 2_17 (and the
    older aliases) for glibc; the plain tag where the C library is not glibc (a musl node: no manylinux)."""
    if libc != "glibc":
        return [f"linux_{machine}"]
    try:
        minor = int(libc_version.split(".")[1])
    except (IndexError, ValueError):
        minor = 17
    tags = [f"manylinux_2_{m}_{machine}" for m in range(minor, 16, -1)] + [f"manylinux2014_{machine}"]
    if machine in ("x86_64", "i686"):
        tags += [f"manylinux2010_{machine}", f"manylinux1_{machine}"]
    return tags


@dataclass(frozen=True)
class WheelSet:
    folder: Path
    wheels: tuple[Path, ...]
    uv: Path | None          # uv's own wheel for the nodes' platform, or None (the nodes install with pip)
    fetched: bool            # False: all of it came from the cache


def _target_args(status) -> list[str]:
    impl = {"cpython": "cp", "pypy": "pp"}.get(status.implementation, "cp")
    args = ["--only-binary=:all:", "--python-version", status.python, "--implementation", impl]
    for tag in pip_platforms(status.machine, status.libc, status.libc_version):
        args += ["--platform", tag]
    return args


def fetch_wheels(env: Environment, status) -> WheelSet:
    """Every wheel the lock resolves to for the node's Python and platform, with uv's: from the cache, else
    downloaded (pip's resolver, the controller's indexes) into it. A failed resolve says what pip said."""
    key = hashlib.sha256("|".join([env.lock_sha or "", status.implementation, status.python, status.machine,
                                   status.libc, status.libc_version]).encode()).hexdigest()[:16]
    folder = cache_root() / "wheels" / key
    if (folder / "complete").is_file():
        return _wheel_set(folder, fetched=False)
    folder.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=folder.parent))
    try:
        (work / "requirements.txt").write_text(env.requirements or "")
        pip = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", *_target_args(status)]
        _pip([*pip, "-d", str(work / "wheels"), "-r", str(work / "requirements.txt")], env.file)
        try:   # uv for the nodes; without a wheel for their platform they install with pip
            _pip([*pip, "--no-deps", "-d", str(work / "tools"), "uv"], "uv")
        except NodectlError:
            pass
        (work / "complete").write_text("")
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(work, folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return _wheel_set(folder, fetched=True)


def _wheel_set(folder: Path, fetched: bool) -> WheelSet:
    wheels = tuple(sorted((folder / "wheels").glob("*.whl")))
    tools = sorted((folder / "tools").glob("uv-*.whl")) if (folder / "tools").is_dir() else []
    return WheelSet(folder, wheels, tools[0] if tools else None, fetched)


def _pip(argv: list[str], what: str) -> None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=FETCH_TIMEOUT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise NodectlError(f"environment: fetching the wheels of {what} took over {FETCH_TIMEOUT:.0f} s") from None
    if proc.returncode != 0:
        said = [line for line in (proc.stderr or proc.stdout).splitlines() if line.startswith("ERROR")] or \
            (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise NodectlError(f"environment: pip could not resolve {what} for the nodes: {' '.join(said)[-600:]}")


def describe(answer) -> str:
    """One line for a node's venv: its key, what it holds, how it was built."""
    packages = f"{answer.packages} packages" if answer.packages else "packages from the node's index"
    return f"venv {answer.key} ({packages}, {answer.installer or '?'}, Python {answer.python})"
