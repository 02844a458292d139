"""nodectl as a user installs it: the wheel built from this tree, installed (not editable) in a venv of its own.

An editable install of the checkout hides whatever a wheel lacks (a package missing from the build, a resource
file not declared as package data), so the installed-product tests (tests/installed/) run the `nodectl` of this
venv. The wheel is built from a copy of the tracked tree, never in place: a stale build/ folder left by an earlier
build would put modules into the wheel that the tree no longer has.

The venv holds the wheel with its `train` extra and torch pinned by NODECTL_TORCH (the CPU build here), as
scripts/setup.sh pins it. It is built once and reused while the wheel's content is the same (its files' hashes,
not the archive's bytes, which carry timestamps): `python -m support.wheelenv` from tests/ builds it ahead of the suite,
as `.ci/run` does, so its minute is not the suite's.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("NODECTL_WHEEL_VENV", REPO / ".wheel-venv"))
TORCH = os.environ.get("NODECTL_TORCH", "torch==2.13.0")


def tracked_files() -> list[str]:
    """What a clone of this tree holds: git's list where there is a repository, else every file but builds."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard"], capture_output=True,
                            text=True)
    if listed.returncode == 0 and listed.stdout.strip():
        return [name for name in listed.stdout.splitlines() if (REPO / name).is_file()]
    skip = {".git", ".venv", "build", "dist", ".wheel-venv", "__pycache__"}
    return [p.relative_to(REPO).as_posix() for p in REPO.rglob("*")
            if p.is_file() and not skip.intersection(p.relative_to(REPO).parts)]


def build_wheel(dest: Path, log: list | None = None) -> Path:
    """The wheel of the tree as a clone has it, built in a copy of that tree; returns its path (and appends what
    the build printed to `log`)."""
    with tempfile.TemporaryDirectory(prefix="nodectl-wheel-src-") as work:
        source = Path(work) / "nodectl"
        for name in tracked_files():
            target = source / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, target)
        built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                                str(dest), str(source)], capture_output=True, text=True, timeout=600)
        if log is not None:
            log.append(built.stdout + built.stderr)
        if built.returncode != 0:
            raise RuntimeError(f"pip wheel failed:\n{built.stdout[-2000:]}{built.stderr[-3000:]}")
    return next(dest.glob("nodectl-*.whl"))


def content_key(wheel: Path) -> str:
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as archive:
        for name in sorted(archive.namelist()):
            digest.update(name.encode() + b"\0" + hashlib.sha256(archive.read(name)).digest())
    return digest.hexdigest()[:16]


def _pip(python: Path, *args: str) -> None:
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", *args], capture_output=True, text=True,
                          timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"pip install {' '.join(args)} failed:\n{done.stderr[-3000:]}")


def ensure(log=sys.stderr) -> Path:
    """The venv's bin/ folder, with the current tree's wheel installed (built and installed where it is not)."""
    VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{VENV}.lock", "a") as lock:   # two pytest-xdist workers may both ask
        fcntl.flock(lock, fcntl.LOCK_EX)
        with tempfile.TemporaryDirectory(prefix="nodectl-wheel-") as dist:
            wheel = build_wheel(Path(dist))
            key = content_key(wheel)
            stamp = VENV / "nodectl-wheel.key"
            if stamp.is_file() and stamp.read_text() == key and (VENV / "bin" / "nodectl").exists():
                return VENV / "bin"
            print(f"installing {wheel.name} ({key}) into {VENV}", file=log)
            python = VENV / "bin" / "python"
            if not python.exists():
                subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
                _pip(python, TORCH)
            _pip(python, "--force-reinstall", "--no-deps", str(wheel))
            _pip(python, f"nodectl[train] @ {wheel.as_uri()}")   # the extra's packages, torch already there
            stamp.write_text(key)
    return VENV / "bin"


def wheel_names(wheel: Path) -> set[str]:
    return set(zipfile.ZipFile(wheel).namelist())


if __name__ == "__main__":
    print(ensure())
