"""Locked environments: venvs built from wheels in the store, their drift found."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

from runctl.common import read_json, walk, write_file
from runctl.runfolder import place_file
from runctl.store import STREAM_BUFFER


# Locked environments (hosts.yaml `environment:`, nodectl/environment.py): one venv per node per lock, built from
# wheels the controller fetched and sent through the object store, under <workdir>/.nodectl/envs/<key>/, where the
# key is the lock's hash with this interpreter's version and platform. Its bytecode is compiled at build, and its
# manifest (every file's size, mtime and ctime, bytecode included) is what later launches compare against: a
# changed, added or removed file is drift. The ctime is what makes an edit in place with its mtime put back, or a
# .pyc planted with the source's mtime and size in its header, show: no user can set a ctime. The venv's files are
# its own copies (uv's link mode `copy`), so an edit in one venv reaches neither uv's cache nor a later venv.
ENV_INFO, ENV_MANIFEST = "nodectl-env.json", "nodectl-manifest.json"
MANIFEST_VERSION = 2


def _platform() -> dict:
    import platform

    libc, version = platform.libc_ver()
    return {"python": "{}.{}".format(*sys.version_info[:2]), "implementation": sys.implementation.name,
            "machine": platform.machine(), "libc": libc or "", "libc_version": version or "",
            "executable": sys.executable}


def _env_key(lock_sha: str, facts: dict) -> str:
    ident = "|".join([lock_sha, facts["implementation"], facts["python"], facts["machine"], facts["libc"],
                      facts["libc_version"]])
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _env_files(env_dir: str) -> dict:
    """relative path -> [size, mtime_ns, ctime_ns] of every file and link of a venv, bytecode included, nodectl's
    own two files aside."""
    found = {}
    for folder, dirs, names in os.walk(env_dir):
        for name in names:
            if folder == env_dir and name in (ENV_INFO, ENV_MANIFEST):
                continue
            path = os.path.join(folder, name)
            info = os.lstat(path)
            found[os.path.relpath(path, env_dir)] = [info.st_size, info.st_mtime_ns, info.st_ctime_ns]
    return found


def _of_copies(manifest: dict) -> bool:
    """A manifest of this nodectl's venvs: their files are copies of uv's cache, never hard links into it."""
    return isinstance(manifest, dict) and manifest.get("version") == MANIFEST_VERSION \
        and isinstance(manifest.get("files"), dict)


def _env_state(env_dir: str) -> dict:
    info = read_json(os.path.join(env_dir, ENV_INFO))
    if not isinstance(info, dict):
        return {"present": False}
    manifest = read_json(os.path.join(env_dir, ENV_MANIFEST), {}) or {}
    if _of_copies(manifest):
        built, now = manifest["files"], _env_files(env_dir)
    else:   # a venv of an older nodectl: no ctimes, no bytecode in its manifest; drift is then rebuilt as ours
        built = manifest
        now = {p: facts[:2] for p, facts in _env_files(env_dir).items()
               if not p.endswith(".pyc") and "/__pycache__/" not in f"/{p}"}
    changed = sorted(p for p in built if p in now and now[p] != built[p])
    added, removed = sorted(set(now) - set(built)), sorted(set(built) - set(now))
    return {"present": True, "intact": not (changed or added or removed), "built": info.get("built"),
            "packages": info.get("packages"), "installer": info.get("installer"), "seconds": info.get("seconds"),
            "changed": changed[:5], "added": added[:5], "removed": removed[:5],
            "drift": len(changed) + len(added) + len(removed)}


def cmd_env_status(args: list, request: dict) -> dict:
    """This node's interpreter and platform, the key of the lock's venv here, and that venv's state."""
    facts = _platform()
    key = _env_key(request["lock_sha"], facts)
    env_dir = os.path.join(os.path.expanduser(args[0]), ".nodectl", "envs", key)
    return dict(facts, key=key, path=env_dir, python_path=os.path.join(env_dir, "bin", "python"),
                **_env_state(env_dir))


def _uv_cache(workdir: str) -> str:
    return os.path.join(workdir, ".nodectl", "uv-cache")


def _uv_binary(workdir: str, store: str, wheel: dict) -> str:
    """uv's executable, taken once from its wheel (a zip; the controller sent it for this platform)."""
    import zipfile

    tools = os.path.join(workdir, ".nodectl", "tools")
    target = os.path.join(tools, "uv-" + wheel["sha256"][:16])
    if os.path.isfile(target):
        return target
    os.makedirs(tools, mode=0o700, exist_ok=True)
    tmp = f"{target}.{os.getpid()}.tmp"
    try:
        with zipfile.ZipFile(os.path.join(store, wheel["sha256"])) as archive:
            name = next(n for n in archive.namelist() if n.endswith(".data/scripts/uv"))
            with archive.open(name) as source, open(tmp, "wb") as sink:
                shutil.copyfileobj(source, sink, STREAM_BUFFER)
        os.chmod(tmp, 0o700)
        os.replace(tmp, target)
    except OSError as exc:   # a full disk, say: nothing half-written is left, and the message names the place
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise RuntimeError(f"unpacking uv into {tools}: {exc.strerror or exc}{_room(tools)}") from None
    return target


def _nearly_full(folder: str) -> bool:
    """Under 1 MiB or no inode left: why a build step failed, whatever it said."""
    try:
        info = os.statvfs(folder)
    except OSError:
        return False
    return info.f_bavail * info.f_frsize < (1 << 20) or (info.f_files > 0 and info.f_favail == 0)


def _room(folder: str) -> str:
    """', N MiB free there' (what a full disk leaves), or ''."""
    try:
        info = os.statvfs(folder)
    except OSError:
        return ""
    return f" ({info.f_bavail * info.f_frsize / 2**20:.1f} MiB free there)"


def cmd_env_build(args: list, request: dict) -> dict:
    """The lock's venv on this node: reused when present and unchanged; else (re)built from the wheels in the
    object store with uv (sent by the controller) or the interpreter's own venv and pip, offline. `index` installs
    from the node's own package index instead. One build at a time per key (a lock file), in place (a venv is not
    relocatable) with its info file written last, so a build cut midway is never taken for a finished one."""
    import fcntl

    workdir = os.path.expanduser(args[0])
    facts = _platform()
    key = _env_key(request["lock_sha"], facts)
    envs = os.path.join(workdir, ".nodectl", "envs")
    env_dir = os.path.join(envs, key)
    os.makedirs(envs, mode=0o700, exist_ok=True)
    with open(os.path.join(envs, key + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = _env_state(env_dir)
        if state.get("present") and state.get("intact"):
            return dict(facts, **state, key=key, python_path=os.path.join(env_dir, "bin", "python"), reused=True)
        replaced = None
        if state.get("present"):   # drifted: kept aside for a look (the last one only), never used again
            replaced = f"{env_dir}.drifted"
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(env_dir, replaced)
            if not _of_copies(read_json(os.path.join(replaced, ENV_MANIFEST), {}) or {}):
                # built with hard links into uv's cache (a nodectl before manifest version 2): the cache may hold
                # the changed bytes. A venv of copies leaves the cache as it was, and the rebuild unpacks nothing.
                shutil.rmtree(_uv_cache(workdir), ignore_errors=True)
        shutil.rmtree(env_dir, ignore_errors=True)   # a build cut midway (no info file)
        started = time.time()
        try:
            installer, packages = _build_env(workdir, env_dir, request)
        except OSError as exc:   # the venv's own files (a full disk): the folder named, nothing half-built kept
            shutil.rmtree(env_dir, ignore_errors=True)
            raise RuntimeError(f"building the venv in {env_dir}: {exc.strerror or exc}{_room(envs)}") from None
        except Exception:
            shutil.rmtree(env_dir, ignore_errors=True)
            raise
        seconds = round(time.time() - started, 2)
        write_file(os.path.join(env_dir, ENV_MANIFEST),
                   json.dumps({"version": MANIFEST_VERSION, "files": _env_files(env_dir)}))
        write_file(os.path.join(env_dir, ENV_INFO), json.dumps({"key": key, "lock_sha": request["lock_sha"],
                                                            "built": time.time(), "installer": installer,
                                                            "packages": packages, "seconds": seconds, **facts}))
    return dict(facts, **_env_state(env_dir), key=key, python_path=os.path.join(env_dir, "bin", "python"),
                reused=False, replaced=replaced)


def _build_env(workdir: str, env_dir: str, request: dict) -> tuple:
    store = os.path.join(workdir, ".nodectl", "objects")
    python = os.path.join(env_dir, "bin", "python")
    wheels = request.get("wheels") or []
    folder = os.path.join(workdir, ".nodectl", "wheels")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    paths, folder_fd = [], walk(os.path.realpath(folder))
    try:
        for wheel in wheels:   # the store names objects by hash; installers need the wheel's file name
            path = os.path.join(folder, wheel["name"])
            if not (os.path.exists(path) and os.path.samefile(path, os.path.join(store, wheel["sha256"]))):
                place_file(os.path.join(store, wheel["sha256"]), folder_fd, wheel["name"], 0o600)
            paths.append(path)
    finally:
        os.close(folder_fd)
    uv = _uv_binary(workdir, store, request["uv"]) if request.get("uv") else None
    # uv unpacks each wheel once into its cache on the node and copies the venv's files from there (hard links
    # would share one inode between the cache and every venv: an edit in one would reach the next venv built).
    env = dict(os.environ, UV_CACHE_DIR=_uv_cache(workdir), UV_LINK_MODE="copy", UV_NO_PROGRESS="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_CACHE_DIR="1")
    env.pop("VIRTUAL_ENV", None)
    if request.get("index"):
        if request["index"] != "default":   # in pip's environment, never its argv (`ps` shows argv to every user)
            env["PIP_INDEX_URL"] = request["index"]
        requirements = os.path.join(folder, "requirements-" + request["lock_sha"][:16] + ".txt")
        write_file(requirements, request["requirements"], 0o600)
        steps = [[sys.executable, "-m", "venv", env_dir],
                 [python, "-m", "pip", "install", "-q",
                  "-r", requirements]]
        installer = "pip (node's index)"
    elif uv:
        steps = [[uv, "venv", "-q", "--python", sys.executable, env_dir],
                 [uv, "pip", "install", "-q", "--python", python, "--offline", "--no-index", "--no-deps",
                  "--compile-bytecode", *paths]]
        installer = "uv"
    else:
        steps = [[sys.executable, "-m", "venv", env_dir],
                 [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", *paths]]
        installer = "pip"
    for argv in steps:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            said = (proc.stderr or proc.stdout).strip()
            if "No space left on device" in said or "Disk quota exceeded" in said or "[Errno 28]" in said \
                    or _nearly_full(os.path.dirname(env_dir)):   # ensurepip says only "returned non-zero exit"
                last = said.splitlines()[-1][-300:] if said else "no words"
                raise OSError(errno.ENOSPC, f"the disk is full ({os.path.basename(argv[0])} {argv[1]} {argv[2]}: "
                                            f"{last})")   # the folder named by the caller
            raise RuntimeError(f"{os.path.basename(argv[0])} {argv[1]} failed ({proc.returncode}): {said[-800:]}")
    # every module's bytecode now, so the manifest holds it and a .pyc that appears later is drift (a file a
    # package ships that does not compile, Python 2 test code say, gets none now or at import: no false drift)
    subprocess.run([python, "-m", "compileall", "-q", "-j", "0", os.path.join(env_dir, "lib")], env=env,
                   stdin=subprocess.DEVNULL, capture_output=True)
    return installer, len(wheels) or None
