"""`container:` in hosts.yaml: every rank of a node runs inside an image (docs/REFERENCE.md §1, "Containers").

One container per node per run, named `nodectl-<run id>-<node>`. docker and podman run it with what distributed
training needs: the host's network, IPC (its /dev/shm) and process table (`--pid host`: the pids ranks record are
the host's, so `stop`, `stacks`, `diagnose` and heartbeats work as without a container), the node's GPUs and
/dev/infiniband where present, memlock and open files at the node's hard limits, the run folder mounted at the path
the rendered scripts use, and the run's environment passed by name (`--env NAME`: values never reach a command
line). apptainer and enroot share the host's namespaces by themselves; they get the same mounts and environment.

This module holds the settings and the commands built from them that nodectl runs itself (probing the image,
checking the runtime, removing a container); launch.sh's `run` command is in templates/launch_node.sh.j2.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Any, Callable

from nodectl.sections import section

RUNTIMES = ("docker", "podman", "apptainer", "enroot")
KEYS = {"image", "runtime", "python", "mounts", "options", "allow_privileged"}
# Options that widen what the container may do to the node beyond what nodectl renders (host network, IPC and
# process table, the GPUs, /dev/infiniband): refused unless the inventory says allow_privileged: true.
PRIVILEGED = ("--privileged", "--cap-add", "--security-opt", "--device", "--device-cgroup-rule", "--userns", "--uts",
              "--cgroupns", "--cgroup-parent", "--volume", "-v", "--mount", "--volumes-from", "--user", "-u",
              "--group-add", "--add-host", "--sysctl", "--fakeroot", "--writable", "--rw", "--root")
# Mount sources that hand the container the node itself: its root, its system folders, a runtime's socket.
PRIVILEGED_SOURCES = ("/", "/etc", "/root", "/boot", "/proc", "/sys", "/dev", "/var/run", "/run", "/usr", "/bin",
                      "/sbin", "/lib", "/var/lib/docker", "/var/lib/containers")
CONTAINER_NAME_MAX = 200


@dataclass(frozen=True)
class Container:
    image: str
    runtime: str = "docker"
    python: str = "python3"                # the interpreter inside the image
    mounts: tuple[str, ...] = ()           # extra SOURCE:TARGET[:OPTIONS], as the runtime writes them
    options: tuple[str, ...] = ()          # extra words for the runtime's run command, before the image
    allow_privileged: bool = False         # options and mounts that widen the container's reach are allowed

    @property
    def gpu_options(self) -> tuple[str, ...]:
        """What gives the container the node's GPUs (CUDA_VISIBLE_DEVICES then picks among them, as on the host)."""
        return {"docker": ("--gpus", "all"),
                "podman": ("--device", "nvidia.com/gpu=all", "--security-opt", "label=disable"),  # CDI
                "apptainer": ("--nv",), "enroot": ()}[self.runtime]  # enroot's hooks read NVIDIA_VISIBLE_DEVICES

    def to_json(self) -> dict:
        return {"image": self.image, "runtime": self.runtime, "python": self.python, "mounts": list(self.mounts),
                "options": list(self.options), "allow_privileged": self.allow_privileged}


def container_name(run_id: str, node_name: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", f"nodectl-{run_id}-{node_name}")
    return name[:CONTAINER_NAME_MAX]


def parse(value: Any, label: str, fail: Callable[[str, str], None]) -> Container | None:
    """A `container:` mapping (or null/false: none), checked; `fail(key, expected)` raises."""
    value = section(value, label, fail, shorthand="image", keys=KEYS, shape="a mapping with at least image: (and "
                    "runtime:, python:, mounts:, options:), or an image name")
    if value is None:
        return None
    for key in ("image", "runtime", "python"):
        item = value.get(key)
        if key in value and (not isinstance(item, str) or not item.strip() or any(c in item for c in "\n\r\0")):
            fail(f"{label}.{key}", f"a non-empty one-line string, got {item!r}")
    if "image" not in value:
        fail(f"{label}.image", "the image to run (e.g. nvcr.io/nvidia/pytorch:25.01-py3, or a .sif/.sqsh path)")
    runtime = value.get("runtime", "docker")
    if runtime not in RUNTIMES:
        fail(f"{label}.runtime", f"one of {', '.join(RUNTIMES)}, got {runtime!r}")
    lists = {}
    for key in ("mounts", "options"):
        items = value.get(key) or []
        if isinstance(items, str):
            items = shlex.split(items) if key == "options" else [items]
        if not isinstance(items, list) or not all(isinstance(i, str) and i and "\0" not in i and "\n" not in i
                                                  for i in items):
            fail(f"{label}.{key}", "a list of strings")
        lists[key] = tuple(items)
    for mount in lists["mounts"]:
        if ":" not in mount or not mount.split(":", 1)[0].startswith("/"):
            fail(f"{label}.mounts", f"SOURCE:TARGET[:OPTIONS] with an absolute SOURCE, got {mount!r}")
    allowed = value.get("allow_privileged", False)
    if not isinstance(allowed, bool):
        fail(f"{label}.allow_privileged", f"true or false, got {allowed!r}")
    if not allowed:
        for option in lists["options"]:
            name = option.split("=", 1)[0]
            if name in PRIVILEGED or (name[:2] in ("-v", "-u") and not name.startswith("--")):   # -v/:/host too
                fail(f"{label}.options", f"no {name}: it widens what the container may do to the node (its "
                                         f"devices, capabilities, namespaces or files; mounts go under mounts:); "
                                         f"set allow_privileged: true for this container if you mean it")
        for mount in lists["mounts"]:
            source = "/" + mount.split(":", 1)[0].strip("/")
            if any(source == p or (p != "/" and source.startswith(p + "/")) for p in PRIVILEGED_SOURCES) or \
                    source.endswith((".sock", "/docker.sock", "/podman.sock")):
                fail(f"{label}.mounts", f"not {mount.split(':', 1)[0]!r}: it hands the container the node's own "
                                        f"system (root, system folders or a runtime's socket); mount your data "
                                        f"folders, or set allow_privileged: true if you mean it")
    return Container(image=value["image"], runtime=runtime, python=value.get("python", "python3"),
                     allow_privileged=allowed, **lists)


def merge(defaults: Any, node: Any) -> Any:
    """A node's `container:` over the defaults': keys it sets replace the defaults'; null/false turns it off."""
    if node is None or node is False or not isinstance(defaults, dict) or not isinstance(node, dict):
        return node
    return {**defaults, **node}


def probe_argv(container: Container, gpus: bool, args: tuple[str, ...] = ()) -> list[str]:
    """The command that runs launchers/probe.py (on stdin) with the image's interpreter in a throwaway container
    with the node's network and, for a GPU node, its GPUs: what preflight judges is what the ranks will run.
    runctl's `container` subcommand runs it (no shell)."""
    runtime = container.runtime
    gpu = list(container.gpu_options) if gpus else []
    if runtime in ("docker", "podman"):
        head = [runtime, "run", "--rm", "-i", "--network", "host", "--ipc", "host", *gpu, *container.options,
                container.image]
    elif runtime == "apptainer":
        head = ["apptainer", "exec", *gpu, *container.options, container.image]
    else:  # enroot: `start` on the image file runs a throwaway root filesystem
        head = ["enroot", "start", *container.options, container.image]
    return [*head, container.python, "-", *args]


def check_request(container: Container, gpus: bool, probe_source: str | None, probe_args: tuple[str, ...] = (),
                  pull: bool = True) -> dict:
    """runctl's `container` request: check the runtime and the image, and (with a probe) probe inside it."""
    request = {"runtime": container.runtime, "image": container.image, "pull": pull}
    if probe_source is not None:
        request["probe"] = {"argv": probe_argv(container, gpus, probe_args), "source": probe_source}
    return request


IMAGE_SECTIONS = ("python", "packages", "torch")   # what ranks get from the image, not from the host


def merge_report(host_report: dict, container: Container, answer) -> dict:
    """A node's probe report as the ranks will see it: the image's Python, packages and torch (so version
    agreement is judged on what runs), the host's hardware, limits and disks; the host's own software kept under
    `host` and the runtime's answer under `container` (env-dump shows both)."""
    report = dict(host_report)
    facts = {**container.to_json(), "installed": answer.installed, "version": answer.version,
             "usable": answer.usable, "usable_output": answer.usable_output, "image_present": answer.image_present,
             "image_id": answer.image_id, "pulled": answer.pulled, "pull_output": answer.pull_output}
    inner = answer.probe
    if isinstance(inner, dict) and not inner.get("error"):
        report["host"] = {key: host_report.get(key) for key in IMAGE_SECTIONS}
        for key in IMAGE_SECTIONS:
            report[key] = inner.get(key)
    else:
        facts["probe_error"] = (inner or {}).get("error") or "the image was not probed (see the runtime's answer)"
        report["host"] = {key: host_report.get(key) for key in IMAGE_SECTIONS}
        report["torch"] = {"error": f"in image {container.image}: {facts['probe_error']}"}
    report["container"] = facts
    return report
