"""The run's container: the runtime checked as the ranks will use it, and removed by the name nodectl gave it."""
from __future__ import annotations

import os
import re
import resource
import shutil

import runlayout as layout
from runctl.common import quiet, read_json
from nodeio import last_json


def cmd_container(args: list, request: dict) -> dict:
    """The node's container runtime, checked as the ranks will use it: installed, usable by this user, its version,
    the image present (docker and podman pull it when missing), and with a `probe` request, launchers/probe.py's
    report from inside the image."""
    runtime, image = request["runtime"], request["image"]
    if not shutil.which(runtime):
        return {"installed": False}
    answer = {"installed": True}
    if runtime in ("docker", "podman"):
        code, out, err = quiet([runtime, "version", "--format", "{{.Client.Version}}"], 30)
        answer["version"] = out.strip() or err.strip()[-300:]
        usable = "{{.Host.OCIRuntime.Name}}" if runtime == "podman" else "{{.ServerVersion}}"
        code, out, err = quiet([runtime, "info", "--format", usable], 60)
        answer["usable"], answer["usable_output"] = code == 0, (err or out).strip()[-600:]
        if code == 0:
            inspect = [runtime, "image", "inspect", "--format", "{{.Id}}", image]
            code, out, err = quiet(inspect, 60)
            if code != 0 and request.get("pull"):
                pulled, pout, perr = quiet([runtime, "pull", image], 3600)
                answer["pulled"], answer["pull_output"] = pulled == 0, (perr or pout).strip()[-600:]
                if pulled == 0:
                    code, out, err = quiet(inspect, 60)
            answer["image_present"] = code == 0
            answer["image_id"] = out.strip() if code == 0 else None
    else:  # apptainer, enroot: the image is a file on the node (or, for apptainer, a URI it pulls at start)
        code, out, err = quiet([runtime, "--version"] if runtime == "apptainer" else [runtime, "version"], 30)
        answer["version"], answer["usable"] = (out or err).strip()[-300:], code == 0
        path = os.path.expanduser(image)
        answer["image_present"] = os.path.isfile(path) if "://" not in image else None
        if answer["image_present"]:
            stat_of = os.stat(path)
            answer["image_id"] = f"{stat_of.st_size}-{int(stat_of.st_mtime)}"
    probe = request.get("probe")
    if probe and answer.get("usable") and answer.get("image_present") is not False:
        argv = list(probe["argv"])
        if runtime in ("docker", "podman"):  # the limits launch.sh gives the ranks: the node's hard limits
            argv[2:2] = [word for kind, name in ((resource.RLIMIT_MEMLOCK, "memlock"), (resource.RLIMIT_NOFILE, "nofile"))
                         for word in ("--ulimit", "{0}={1}:{1}".format(name, _hard_limit(kind)))]
        code, out, err = quiet(argv, 240, stdin=probe["source"])
        report = last_json(out)
        answer["probe"] = report if isinstance(report, dict) else \
            {"error": f"the probe in the image exited {code}: {(err or out).strip()[-600:]}"}
    return answer


def _hard_limit(kind: int) -> int:
    hard = resource.getrlimit(kind)[1]
    return -1 if hard == resource.RLIM_INFINITY else hard


def container_name(run_id: str, node: str) -> str:
    """The name launch.sh gives the run's container (nodectl/container.py's rule)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", f"nodectl-{run_id}-{node}")[:200]


def remove_container(run_dir: str) -> dict:
    """The run's container on this node, removed with whatever still runs in it; what the runtime said, or {} when
    the run has none. Only the container nodectl named for this run, and (docker, podman) only while it still
    carries this run's label: a rewritten node.json never names another container to remove."""
    node = read_json(os.path.join(run_dir, layout.NODE_JSON), {}) or {}
    container = node.get("container") if isinstance(node, dict) else None
    if not isinstance(container, dict) or container.get("runtime") not in ("docker", "podman", "enroot"):
        return {}
    runtime, run_id = container["runtime"], str(node.get("run_id"))
    name = container_name(run_id, str(node.get("node")))
    if container.get("name") != name:
        return {"container": name, "removed": False,
                "error": f"node.json names container {str(container.get('name'))[:80]!r}, not this run's {name}: "
                         f"left alone"}
    if runtime != "enroot":
        code, out, err = quiet([runtime, "inspect", "--format", '{{ index .Config.Labels "nodectl.run" }}', name], 60)
        if code == 0 and out.strip() != run_id:
            return {"container": name, "removed": False,
                    "error": f"{name} is not labelled nodectl.run={run_id}: not this run's, left alone"}
    argv = [runtime, "rm", "-f", name] if runtime != "enroot" else [runtime, "remove", "-f", name]
    code, out, err = quiet(argv, 60)
    gone = code == 0 or "no such container" in (err + out).lower() or "no container with" in (err + out).lower()
    return {"container": name, "removed": gone, **({} if gone else {"error": (err or out).strip()[-300:]})}
