"""Running a preflight: probe, P2P, port and route facts from every node in parallel, then judge them."""
from __future__ import annotations

import hashlib
import ipaddress
import shlex
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from nodectl.inventory import Inventory
from nodectl.preflight.gpu import cluster_medians, held_clocks_that_slow
from nodectl.preflight.history import Drift, Figure, History, curve_of, figures_of, judge_history, versions_of
from nodectl.preflight.checks import Tier
from nodectl.probe_report import ProbeReport
from nodectl.preflight.judge import Expectation, NodeFacts, judge_cluster, judge_node
from nodectl.preflight.storage import judge_store
from nodectl.preflight.verdict import FAIL, WARN, CheckResult
from nodectl.plan import visible_devices
from nodectl.progress import NodeProgress
from nodectl.remote.answers import AnswerError, parse_gpu_job
from nodectl.remote.probe_nodes import probe_nodes
from nodectl.resources import resource_dir
from nodectl.runs import private_folder, runs_root
from nodectl.transport import Cluster, NodeResult, Session, Transport, quote_path
from nodectl.remote.client import NodeClient

REUSE_SECONDS = 600


@dataclass
class PreflightReport:
    nodes: list[str]
    results: list[CheckResult]
    reports: dict[str, dict] = field(default_factory=dict)
    unreachable: dict[str, str] = field(default_factory=dict)
    collective: dict | None = None
    collective_run: str | None = None
    quick: bool = True
    created: float = field(default_factory=time.time)
    gpu_jobs: dict[str, dict] = field(default_factory=dict)   # per node: the GPU job's figures (not --quick)
    history: str = ""     # what the history said of the measured figures (one line)

    @property
    def failed(self) -> list[CheckResult]:
        return [r for r in self.results if r.verdict == FAIL]

    @property
    def warned(self) -> list[CheckResult]:
        return [r for r in self.results if r.verdict == WARN]

    def recommended_env(self) -> dict[str, dict[str, str]]:
        """Per node: the variables hints recommend, for that node's env: in hosts.yaml."""
        env: dict[str, dict[str, str]] = {}
        for result in self.results:
            if result.env and result.verdict in (FAIL, WARN) or (result.env and result.check == "interface"):
                env.setdefault(result.node, {}).update(result.env)
        return env

    def to_json(self) -> dict:
        return {"nodes": self.nodes, "created": self.created, "quick": self.quick,
                "passed": not self.failed and not self.unreachable, "unreachable": self.unreachable,
                "results": [r.to_json() for r in self.results], "collective": self.collective,
                "collective_run": self.collective_run, "recommended_env": self.recommended_env(),
                "gpu_jobs": self.gpu_jobs, "reports": self.reports, "history": self.history}


def selection_key(inventory: Inventory, gpus: int | None) -> str:
    identity = [(n.name, n.host, n.port, n.user, n.python, n.workdir, n.device) for n in inventory.nodes]
    # a passing report without a bucket's check is no pass for a launch with one
    stores = [n.outputs.to_json() if n.outputs else None for n in inventory.nodes]
    return hashlib.sha256(json.dumps([identity, gpus, stores]).encode()).hexdigest()[:16]


def cached_path(inventory: Inventory, gpus: int | None) -> Path:
    return runs_root() / ".preflight" / f"{selection_key(inventory, gpus)}.json"


def _gpu_job(transport: Transport) -> dict:
    """launchers/gpuhealth.py on the node, with the CUDA_VISIBLE_DEVICES its ranks get: per-GPU GEMM, HBM and
    host-copy figures under load, and every GPU pair's checked peer copy."""
    node = transport.node
    source = (resource_dir("launchers") / "gpuhealth.py").read_text()
    visible = node.env.get("CUDA_VISIBLE_DEVICES")
    prefix = f"CUDA_VISIBLE_DEVICES={shlex.quote(visible)} " if visible is not None else ""
    result, answer = NodeClient(transport).script(f"{prefix}{quote_path(node.python)} -", source, timeout=300)
    if answer is None:
        return {"error": f"exit {result.exit_code}: {result.tail(3)}"}
    try:
        job = parse_gpu_job(answer)
    except AnswerError as exc:
        return {"error": str(exc)}
    # the history keys this node's GPUs by its name and the host key the connection verified (history.py)
    return {**job, "host_key": transport.host_key()}


def _facts(cluster: Cluster, inventory: Inventory, reports: dict[str, ProbeReport], port: int | None,
           quick: bool = True) -> tuple[dict[str, dict], int | None]:
    """(per node: the GPU job on GPU nodes (not --quick), node 0's master port, every node's connection to it and
    route toward it, the other nodes' connections to a port of its ephemeral range (`peer_ports`), how it resolves
    node 0's `addr:` when that is a name (`master_name`); the master port the checks tried, None when node 0 could
    not take one)."""
    master = inventory.nodes[0]
    reachable = [n for n in inventory.nodes if n.name in reports]
    extras: dict[str, dict] = {n.name: {} for n in reachable}
    gpu_nodes = [n for n in reachable if n.device == "cuda"
                 and (reports[n.name].gpus.count or 0) >= 1]
    for r in cluster.fan_out(_gpu_job, [] if quick else gpu_nodes):
        extras[r.node.name]["p2p"] = r.value if r.ok else {"error": r.error}
    if master.name not in reports:
        return extras, None
    port_answer = cluster.fan_out(lambda t: NodeClient(t).port(port or 0), [master])[0]
    if not port_answer.ok:
        return extras, None
    extras[master.name]["port"] = asdict(port_answer.value)   # the judges read plain facts, as saved
    chosen = port_answer.value.port if port_answer.value.free else None
    if chosen is None:
        return extras, None
    # With more than one node, every node also listens on a port from its ephemeral range, as gloo and NCCL do for
    # the connections between ranks, and every other node connects to it: a firewall that lets SSH and the master
    # port in but not those is named here, not as a collective that fails with node 0 blamed.
    several = len(reachable) > 1
    # the other nodes' listeners end by themselves once each other node connected (no call to end them)
    listeners = {r.node.name: r for r in cluster.fan_out(lambda t: NodeClient(t).listen(
        chosen if t.node.name == master.name else 0, 30, ephemeral=several,
        expect=0 if t.node.name == master.name else len(reachable) - 1), reachable if several else [master])}
    ephemeral = _ephemeral_ports(reachable, listeners)
    resolve = None if _is_address(master.addr) else master.addr   # a name: how each node resolves it
    try:   # one call per node: the connection to the master's port, then the routes to every other node
        route = cluster.fan_out(lambda t: NodeClient(t).route(
            master.addr, tuple(n.addr for n in reachable if n.name != t.node.name), connect=chosen,
            peer_ports={addr: port for addr, (name, port) in ephemeral.items() if name != t.node.name},
            resolve=resolve), reachable)
    finally:
        if listeners[master.name].ok:
            cluster.fan_out(lambda t: NodeClient(t).unlisten(listeners[master.name].value.pid), [master])
    answered = {r.node.name: r.value for r in route if r.ok}
    for r in route:
        reach = r.value.reach if r.ok else None
        extras[r.node.name]["reach"] = asdict(reach) if reach is not None else \
            {"ok": False, "error": r.error if not r.ok else "no answer to the connection test"}
        extras[r.node.name]["route"] = {k: v for k, v in asdict(r.value).items()
                                        if k not in ("reach", "peer_reach", "resolved", "resolved_line", "own")} \
            if r.ok else None
    for addr, (name, port) in ephemeral.items():   # keyed by the node listened on: who could reach it
        extras[name]["peer_ports"] = {
            "port": port, "range": listeners[name].value.ephemeral_range,
            "from": {n.name: asdict(answered[n.name].peer_reach[addr]) for n in reachable
                     if n.name != name and n.name in answered and addr in answered[n.name].peer_reach}}
    if resolve and master.name in answered:
        own = answered[master.name].resolved
        master_has = sorted({a.split("/")[0] for nic in reports[master.name].nics for a in nic.addresses}
                            | set(answered[master.name].own) | set(own if isinstance(own, tuple) else ()))
        for n in reachable:
            if n.name != master.name and n.name in answered:
                extras[n.name]["master_name"] = {"name": resolve, "resolved": answered[n.name].resolved,
                                                 "line": answered[n.name].resolved_line, "master": master.name,
                                                 "master_has": master_has}
    return extras, chosen


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def _ephemeral_ports(nodes, listeners: dict) -> dict[str, tuple[str, int]]:
    """{address: (node, port)} of each node's ephemeral listener; nodes sharing an address are not told apart,
    so none of them is tested."""
    by_addr: dict[str, list] = {}
    for n in nodes:
        by_addr.setdefault(n.addr, []).append(n)
    out = {}
    for addr, named in by_addr.items():
        answer = listeners.get(named[0].name)
        if len(named) == 1 and answer is not None and answer.ok and answer.value.ephemeral:
            out[addr] = (named[0].name, answer.value.ephemeral)
    return out


# Runs a launcher read from stdin (its length first), which then reads its request from the rest of stdin: the
# request carries the node's credentials, which must never sit on a command line. One line, no backslash.
STDIN_SCRIPT = ('import sys;n=int(sys.argv[1]);b=sys.stdin.buffer.read(n);sys.argv=["-"]+sys.argv[2:];'
                'exec(compile(b,"nodectl_outputs.py","exec"),{"__name__":"__main__"})')
STORE_TIMEOUT = 60.0


def _store_check(transport: Transport, outputs) -> dict:
    """A probe object written and deleted where the run's outputs go, from the node, with the node's credentials
    (its env:, else its own environment or AWS profile) and Python (whose boto3 the uploader will use)."""
    node = transport.node
    source = (resource_dir("launchers") / "nodectl_outputs.py").read_bytes()
    request = {"outputs": outputs.to_json(), "node": node.name,
               "env": {k: v for k, v in node.env.items() if k.startswith("AWS_") or k == "PYTHONPATH"}}
    command = f"{quote_path(node.python)} -c {shlex.quote(STDIN_SCRIPT)} {len(source)} check"
    result, answer = NodeClient(transport).script(command, source + json.dumps(request).encode(),
                                                  timeout=STORE_TIMEOUT)
    if answer is None:
        return {"ok": False, "error": f"the check exited {result.exit_code}: {result.tail(3)}"}
    return answer


PROBE_HINTS = {
    "reachable": "check SSH: ssh to it by hand, the inventory's user/port/identity_file, known_hosts",
    "python": "python: in hosts.yaml must name an interpreter on that node (with torch for training)",
    "workdir": "workdir: in hosts.yaml must be a folder the login user can create and write",
    "disk": "free space on the node's workdir disk",
    "probe": "run the probe by hand: nodectl -v env-dump --nodes N, or python3 - < launchers/probe.py on the node",
}


def _probe_failure(result: NodeResult) -> CheckResult:
    """A node without a probe report: unreachable, or reachable but the probe could not run (and why)."""
    if not result.ok:
        return CheckResult("reachable", result.node.name, FAIL, result.error, PROBE_HINTS["reachable"])
    check = result.value.get("check", "probe")
    return CheckResult(check, result.node.name, FAIL, result.value.get("error", "probe failed"),
                       PROBE_HINTS.get(check, PROBE_HINTS["probe"]))


def run_preflight(inventory: Inventory, session: Session, *, gpus: int | None, tier: Tier,
                  on_probe: NodeProgress | None = None) -> PreflightReport:
    """The probe's checks on every node, and at a measured tier the GPU job: what a launch's quick gate and a
    restart's node check judge. The tiers' collective jobs come after (collective_job.add_collectives); the
    whole sequence is sequence.preflight."""
    quick = not tier.measured
    # --quick reads torch's versions from its installed files (importing it is most of a quick preflight on a GPU
    # node: 3-4 s); the default tier imports it and asks CUDA.
    cluster = session.cluster(inventory.nodes)
    probed = probe_nodes(cluster, on_done=on_probe, import_torch=not quick, visible=visible_devices(inventory, gpus),
                         ranks_env=True)
    reports = {name: report for name, report in probed.succeeded.items() if "error" not in report}
    typed = {name: ProbeReport.of(report) for name, report in reports.items()}   # what the checks read
    unreachable = {r.node.name: r.error for r in probed if r.unreachable}
    results = [_probe_failure(r) for r in probed if r.node.name not in reports]
    phase = on_probe.phase if on_probe is not None else (lambda text: None)
    phase("port checks" if quick else "GPU load, P2P and port checks")
    extras, port = _facts(cluster, inventory, typed, inventory.master_port, quick)
    expect = Expectation(gpus=gpus, master_port=port, master_addr=inventory.nodes[0].addr, nodes=len(inventory.nodes))
    devices = {n.name: n.device for n in inventory.nodes}
    jobs = {name: facts.get("p2p") for name, facts in extras.items() if facts.get("p2p")}
    medians = cluster_medians(jobs)
    for node in inventory.nodes:
        if node.name in reports:
            results += judge_node(NodeFacts(node.name, typed[node.name], node.device, expect,
                                            extras.get(node.name) or {}, node.env, node.gpus, medians, node.addr),
                                  tier)
    uploading = [n for n in inventory.nodes if n.name in reports and n.outputs is not None]
    if uploading:
        phase("object store checks")
        stored = cluster.fan_out(lambda t: _store_check(t, t.node.outputs), uploading)
        results += judge_store([(r.node.name, r.node.outputs.url, r.value if r.ok else {"ok": False, "error": r.error})
                                for r in stored])
    if len(reports) > 1:
        results += judge_cluster(typed, {k: v for k, v in devices.items() if k in reports}, tier)
    return PreflightReport([n.name for n in inventory.nodes], results, reports, unreachable, quick=quick,
                           gpu_jobs=jobs)


def compare_with_history(report: PreflightReport, history: History, warn: float, fail: float) -> Drift:
    """A measured preflight's figures against each part's own past (its verdicts join the report's), then kept."""
    if report.quick:
        return Drift()
    figures = figures_of(report.reports, report.gpu_jobs, report.collective)
    nodes = "+".join(sorted(report.nodes))
    tier = "full" if (report.collective or {}).get("pairs") else "default"
    figures.append(Figure(f"preflight:{tier}:{nodes}", "seconds", round(time.time() - report.created, 1), "cluster",
                          f"the {tier} preflight of {nodes}", judged=False))
    drift = judge_history(figures, history.entries(), warn, fail)
    report.results += list(drift.results)
    report.results += held_clocks_that_slow({n: ProbeReport.of(r) for n, r in report.reports.items()}, drift.fallen)
    report.history = drift.summary
    if figures:
        try:
            history.add(figures, versions_of(report.reports), report.nodes, curve=curve_of(report.collective))
        except OSError:   # an unwritable registry costs the record, never the preflight
            pass
    return drift


def save(report: PreflightReport, inventory: Inventory, gpus: int | None) -> Path:
    path = cached_path(inventory, gpus)
    private_folder(path.parent)
    path.write_text(json.dumps(report.to_json(), indent=2, default=str))
    return path


def reusable(inventory: Inventory, gpus: int | None) -> dict | None:
    """A passing report for the same nodes and GPU count, under 10 minutes old."""
    path = cached_path(inventory, gpus)
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if document.get("passed") and time.time() - document.get("created", 0) < REUSE_SECONDS:
        return document
    return None
