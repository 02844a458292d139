"""The container image the container tests run: Debian bookworm with a Python holding torch (CPU), PyYAML,
transformers, peft and safetensors, built here from a root filesystem (there is no registry to pull from).

Built once per machine and cached: the image is tagged with a key of what goes into it, and `podman image exists`
skips the build when that tag is present. `python -m support.images` (from tests/) builds it ahead of the suite (`.ci/run` does),
so its minutes are not the suite's. Needs root, debootstrap, podman and runc (scripts/setup.sh installs them).
"""
from __future__ import annotations

import hashlib
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PACKAGES = ("torch==2.13.0", "pyyaml", "safetensors", "transformers", "peft")
DEBIAN = ("bookworm", "http://deb.debian.org/debian")
INCLUDE = "python3,python3-pip,procps,ca-certificates"
RECIPE = 1  # bump when the steps below change
CACHE = Path(os.environ.get("NODECTL_TEST_IMAGE_CACHE", "/var/cache/nodectl-tests"))
PODMAN = ("podman", "--runtime", "runc")
# podman 4.3 as root asks for more processes and open files than this machine's kernel lets a container have
RUN_LIMITS = ("--ulimit", "nproc=32768:32768", "--ulimit", "nofile={0}:{0}".format(resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


def image_tag() -> str:
    key = hashlib.sha256(repr((PACKAGES, DEBIAN, INCLUDE, RECIPE)).encode()).hexdigest()[:12]
    return f"localhost/nodectl-test-torch:{key}"


def available() -> str:
    """Why the image cannot be built or run here ("" when it can)."""
    if os.geteuid() != 0:
        return "container tests need root (podman as the simulated nodes' root user)"
    missing = [tool for tool in ("podman", "runc", "debootstrap") if not shutil.which(tool)]
    if missing:
        return f"{', '.join(missing)} not installed (scripts/setup.sh installs them)"
    return ""


def image_exists(tag: str) -> bool:
    return subprocess.run([*PODMAN, "image", "exists", tag], capture_output=True).returncode == 0


def build(tag: str | None = None, log=sys.stderr) -> str:
    """The image's tag, built first where it is missing (a few minutes: debootstrap, then the wheels)."""
    tag = tag or image_tag()
    if image_exists(tag):
        return tag
    CACHE.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with tempfile.TemporaryDirectory(dir=CACHE, prefix="build-") as work:
        rootfs, wheels = Path(work) / "rootfs", Path(work) / "rootfs" / "wheels"
        _run(["debootstrap", "--variant=minbase", f"--include={INCLUDE}", DEBIAN[0], str(rootfs), DEBIAN[1]], log)
        wheels.mkdir()
        # the controller's pip (its find-links hold the CPU torch) fetches: the image's Python is 3.11 on x86_64,
        # as the controller's is here
        _run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", str(wheels), *PACKAGES], log)
        _run(["chroot", str(rootfs), "python3", "-m", "pip", "install", "-q", "--break-system-packages",
              "--no-index", "--find-links", "/wheels", "--no-compile", *PACKAGES], log)
        shutil.rmtree(wheels)
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists", "root/.cache"):
            shutil.rmtree(rootfs / cache, ignore_errors=True)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        _run([*PODMAN, "import", "--change", "CMD=/bin/bash", "-", tag], log, stdin=tar.stdout)
        tar.wait()
    print(f"built {tag} in {time.time() - started:.0f} s", file=log)
    return tag


def _run(argv: list[str], log, stdin=None) -> None:
    proc = subprocess.run(argv, stdin=stdin, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} ... failed ({proc.returncode}): {(proc.stderr or proc.stdout)[-2000:]}")


if __name__ == "__main__":
    why = available()
    if why:
        print(f"test image not built: {why}", file=sys.stderr)
        sys.exit(0)
    try:
        print(build())
    except (RuntimeError, OSError) as exc:   # the suite's fixture tries again, and fails the tests that need it
        print(f"test image not built: {exc}", file=sys.stderr)
