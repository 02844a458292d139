"""Running launchers/probe.py on nodes and keeping what it reports, with the clock skew seen from here."""
from __future__ import annotations

import dataclasses
import json
import shlex
import time
from typing import Iterable, Mapping

from nodectl import container as containers
from nodectl.remote.agent import classify_failure
from nodectl.remote.answers import AnswerError, parse_probe
from nodectl.inventory import Node
from nodectl.resources import resource_dir
from nodectl.transport import Cluster, FanOut, NodeError, Transport, quote_path
from nodectl.remote.client import NodeClient

PROBE_TIMEOUT = 90.0
CONTAINER_TIMEOUT = 3600.0   # a missing image is pulled (tens of GB for an NGC image)


class ProbeFailed(Exception):
    """The probe did not report; `check` names what is wrong (python, workdir, disk, probe)."""

    def __init__(self, message: str, check: str = "probe") -> None:
        super().__init__(message)
        self.check = check


# Lines of launchers/probe.py (each at a line's start) that probe_source replaces by the module they import
INLINED = (("\nfrom redaction import redact_env", "redaction.py"), ("\nfrom hostsfile import hosts_line", "hostsfile.py"))


def probe_source() -> str:
    """launchers/probe.py as the one script a node's `python3 -` runs: the modules it imports from launchers/
    (redaction.py's rules, hostsfile.py's reader; but their `from __future__` line, which probe.py has already) in
    place of its imports of them."""
    launchers = resource_dir("launchers")
    probe = (launchers / "probe.py").read_text(encoding="utf-8")
    for line, module in INLINED:
        inlined = (launchers / module).read_text(encoding="utf-8").replace("from __future__ import annotations\n", "", 1)
        head, found, rest = probe.partition(line)
        if not found:
            raise RuntimeError(f"launchers/probe.py lacks its `{line.strip()}` line")
        probe = head + "\n" + inlined + rest.partition("\n")[2]
    return probe


def run_probe(transport: Transport, source: str | None = None, import_torch: bool | None = None,
              visible: str | None = None) -> dict:
    """One node's report. `clock.skew_s` is the node's clock minus the controller's, at the probe's midpoint.
    import_torch: True proves torch imports (preflight); None lets the probe import it only where GPUs are.
    visible: the CUDA_VISIBLE_DEVICES the node's ranks will get, so the GPUs judged are the ones they use."""
    node = transport.node
    flag = {True: " --import-torch", False: " --no-import-torch", None: ""}[import_torch]
    prefix = f"CUDA_VISIBLE_DEVICES={shlex.quote(visible)} " if visible is not None else ""
    environment, python = None, node.python
    if node.environment is not None and node.environment.lock_sha:
        try:
            environment = NodeClient(transport).env_status(node.environment.lock_sha)
        except NodeError as exc:
            raise ProbeFailed(f"{node.name}: asking about its environment failed: {exc}", "environment") from None
        if environment.present and environment.intact:
            python = environment.python_path   # judge what the ranks will run
    command = f"{prefix}{quote_path(python)} - {quote_path(node.workdir)}{flag}"
    before = time.time()
    result, answer = NodeClient(transport).script(command, source or probe_source(), timeout=PROBE_TIMEOUT)
    after = time.time()
    if not result.ok:
        check, message = classify_failure(node, f"the probe `{command}`", result)
        raise ProbeFailed(message, check)
    if answer is None:
        raise ProbeFailed(f"probe on {node.name} printed no report: {result.tail(5)}")
    try:
        report = parse_probe(answer)
    except AnswerError as exc:
        raise ProbeFailed(f"probe on {node.name} answered malformed: {exc}") from None
    report.setdefault("clock", {})
    if isinstance(report["clock"].get("time"), (int, float)):
        # The node read its clock somewhere inside [before, after]; its start-up (imports) sits before that
        # read, so the midpoint of the round trip overstates skew by at most half the probe's time.
        report["clock"]["skew_s"] = round(report["clock"]["time"] - (before + after) / 2, 3)
        report["clock"]["round_trip_s"] = round(after - before, 3)
    if node.container is not None:
        request = containers.check_request(node.container, gpus=node.device == "cuda",
                                           probe_source=source or probe_source(),
                                           probe_args=("/", *flag.split()))
        try:
            answer = NodeClient(transport).container(request, timeout=CONTAINER_TIMEOUT)
        except NodeError as exc:
            raise ProbeFailed(f"{node.name}: checking its container runtime failed: {exc}", "container") from None
        report = containers.merge_report(report, node.container, answer)
    if environment is not None:
        report["environment"] = {"file": node.environment.file, "install": node.environment.install,
                                 **dataclasses.asdict(environment)}
    report["node"] = {"name": node.name, "host": node.host, "addr": node.addr, "index": node.index,
                      "transport": node.transport, "device": node.device}
    return report


def with_environment(source: str, env: Mapping[str, str]) -> str:
    """The probe's source with `env` put into its os.environ before anything reads it (after the `from
    __future__` line, which must come first): it then finds the temp folder, the caches and the distributed
    variables as the node's ranks will have them. The values travel inside the source, on stdin, never on a
    command line that another user's `ps` could read."""
    marker = "from __future__ import annotations\n"
    if not env or marker not in source:
        return source
    head, _, tail = source.partition(marker)
    # PYTHONPATH is read at the interpreter's start: its entries go onto sys.path as they would have
    preamble = (f"import os as _os, sys as _sys\n_os.environ.update({json.dumps(dict(env))})\n"
                f"_sys.path[1:1] = [p for p in {json.dumps(env.get('PYTHONPATH', ''))}.split(':') if p]\n")
    return f"{head}{marker}{preamble}{tail}"


def probe_nodes(cluster: Cluster, nodes: Iterable[Node] | None = None, on_done=None,
                import_torch: bool | None = None, visible: Mapping[str, str] | None = None,
                ranks_env: bool = False) -> FanOut[dict]:
    """Every node's report; with `ranks_env`, read under the node's inventory env: laid over its login
    environment, as its ranks get it (preflight judges those; env-dump shows the node as it is)."""
    source = probe_source()
    visible = visible or {}

    def work(transport: Transport) -> dict:
        node_source = with_environment(source, transport.node.env) if ranks_env else source
        return run_probe(transport, node_source, import_torch, visible.get(transport.node.name))

    def guarded(transport: Transport) -> dict:
        try:
            return work(transport)
        except ProbeFailed as exc:
            return {"error": str(exc), "check": exc.check,
                    "node": {"name": transport.node.name, "host": transport.node.host}}

    return cluster.fan_out(guarded, nodes, on_done=on_done)
