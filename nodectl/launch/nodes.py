"""Acting on a LaunchPlan: port check, run folders that never collide, code sync, and the detached start.

Starting is two phases over every node: first each node gets its code and its prepared run folder, then, only
if every node is ready and nobody cancelled (Ctrl-C, SIGTERM), each node starts. A failure or an interrupt
during the sync therefore starts nothing, and nothing half-sent is left on a node.
"""
from __future__ import annotations

import dataclasses
import json
import threading
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from nodectl.container import container_name
from nodectl.remote import sync
from nodectl.remote.collect import share_output
from nodectl.errors import Cancelled, NodectlError, UnreachableError, UsageError
from nodectl.runs import live_runs_on
from nodectl.plan import LaunchPlan, NodePlan, with_port
from nodectl.render import RenderedNode
from nodectl.transport import Cluster, FanOut, NodeError, NodeErrorKind, NodeResult, Transport
from nodectl.remote.client import NodeClient


class Prepared(NamedTuple):
    """A node ready to start: its code in its store and run folder laid out."""
    files: int      # the project's files in its run folder
    sent: int       # bytes sent to it for that (what its store lacked)


@dataclass(frozen=True)
class NodeStart:
    node: str
    pgid: int
    files: int
    bytes_sent: int


def settle_master_port(plan: LaunchPlan, cluster: Cluster, move: bool = False) -> LaunchPlan:
    """Make sure node 0 can listen on the master port; move a port nodectl chose (or, with `move`, the
    inventory's) if it is taken."""
    master = plan.nodes[0].node
    answer = cluster.fan_out(lambda t: NodeClient(t).port(plan.master_port), [master])[0]
    if answer.unreachable:
        raise UnreachableError(f"{master.name}: {answer.error}")
    if not answer.ok:
        raise NodectlError(f"{master.name}: cannot check master port {plan.master_port}: {answer.error}")
    if answer.value.free:
        return plan
    if plan.port_was_chosen or move:
        return with_port(plan, answer.value.port)
    holders = [run.run_id for run in live_runs_on(master.host, plan.master_port) if run.run_id != plan.run_id]
    held = (f" by run {holders[0]}, recorded as still running (nodectl status --run {holders[0]}; nodectl stop --run "
            f"{holders[0]} ends it)" if holders else "")
    raise NodectlError(f"master_port {plan.master_port} is in use on {master.name}{held}. Choices: stop what holds "
                       f"it; pick another master_port in the inventory (or leave it out: nodectl then picks a free "
                       f"one); or launch --force to start this run on a free port anyway")


@dataclass(frozen=True)
class Survey:
    shared: frozenset[str]  # nodes whose run folders need a per-node subfolder (see shared_workdirs)
    missing: dict[str, list[str]]  # node name -> the objects its store lacks, when files were given
    cpus: dict[str, dict] = field(default_factory=dict)  # node name -> its CPUs and boot id, as a probe's "cpu"


def survey(plan: LaunchPlan, cluster: Cluster, files: list[sync.SyncFile] | None = None) -> Survey:
    """Ask every node which storage its workdir is and, with `files`, which objects its store lacks (one call
    per node for both). Nodes whose workdir is the same storage as another node's (an NFS home) and whose
    planned run folders would therefore collide need a per-node subfolder; none do when the folders are apart
    already (several local "nodes" of one machine are planned apart). Every node must answer (a node not asked
    could share a folder unseen): one that does not, after a second try, stops the launch before anything
    started."""
    request = sync.have_request(files) if files is not None else None
    ask = lambda t: NodeClient(t).identity(request)  # noqa: E731
    first = cluster.fan_out(ask, [np.node for np in plan.nodes])
    again = cluster.fan_out(ask, [r.node for r in first.failed if not r.unreachable])
    results = FanOut({**first.by_node(), **again.by_node()}.values())   # node order kept
    if failed := results.failed:
        detail = "; ".join(r.said for r in failed)
        if any(r.unreachable for r in failed):
            raise UnreachableError(detail)
        if any(r.failure.kind == NodeErrorKind.UNSAFE for r in failed):
            raise UsageError(detail)
        raise NodectlError(f"cannot tell whether the nodes share their workdir: {detail}")
    seen: dict[str, list[str]] = {}
    for name, answer in results.succeeded.items():
        seen.setdefault(answer.identity, []).append(name)
    shared = {name for names in seen.values() if len(names) > 1 for name in names}
    run_dirs = [np.run_dir for np in plan.nodes if np.node.name in shared]
    missing = {name: list(answer.missing) for name, answer in results.succeeded.items() if answer.missing is not None}
    cpus = {name: dataclasses.asdict(answer.cpu) for name, answer in results.succeeded.items() if answer.cpu}
    return Survey(frozenset(shared) if len(set(run_dirs)) < len(run_dirs) else frozenset(), missing, cpus)


def _node_json(plan: LaunchPlan, node_plan: NodePlan) -> str:
    container = node_plan.node.container
    return json.dumps({"run_id": plan.run_id, "node_rank": node_plan.node_rank, "nproc": node_plan.nproc,
                       "ranks": node_plan.ranks, "nnodes": plan.nnodes, "node": node_plan.node.name,
                       "attempt": plan.attempt, "device": node_plan.node.device,
                       "cuda_visible": node_plan.env.get("CUDA_VISIBLE_DEVICES"),
                       "container": container and {"runtime": container.runtime, "image": container.image,
                                                   "name": container_name(plan.run_id, node_plan.node.name)}})


def prepare_node(transport: Transport, plan: LaunchPlan, node_plan: NodePlan, rendered: RenderedNode,
                 files: list[sync.SyncFile], cancel: threading.Event,
                 missing: list[str] | None = None) -> Prepared:
    """Send what the node lacks (`missing`, or asked now) and lay out its run folder, in one call when
    anything is sent; (files, bytes sent)."""
    request = {
        "workdir": node_plan.node.workdir, "run_dir": node_plan.run_dir,
        "new_attempt": plan.attempt > 0,
        "files": [f.entry() for f in files],
        "rendered": {"launch.sh": {"text": rendered.launch, "mode": 0o700},
                     "env.sh": {"text": rendered.env, "mode": 0o600},
                     "node.json": {"text": _node_json(plan, node_plan), "mode": 0o644}},
    }
    if node_plan.node.outputs is not None:   # what the node's uploader needs (launchers/nodectl_outputs.py)
        request["rendered"]["lib/outputs.json"] = {
            "text": json.dumps(node_plan.node.outputs.node_config(plan.run_id, node_plan.node.name)), "mode": 0o644}
    if missing is None:
        missing = sync.missing_objects(transport, files)
    if cancel.is_set():
        raise Cancelled("interrupted before the run folder was prepared")
    if missing:
        sent, prepared = sync.send_objects(transport, files, missing, cancel, then=request)
    else:
        sent, prepared = 0, NodeClient(transport).prepare(request)
    return Prepared(prepared.files, sent)


def pull_outputs(transport: Transport, plan: LaunchPlan, node_plan: NodePlan):
    """The node's share of the run's outputs from the bucket, into its run folder's output/ (runctl pull)."""
    sources = [{"node": node_plan.node.name}]
    first = plan.nodes[0].node
    if node_plan.node_rank != 0 and not plan.builtin_trainer and first.outputs is not None:
        # the built-in trainer's ranks write their own; a script's rank 0 may be the only writer
        sources.append({"node": first.name, "missing_only": True, "outputs": first.outputs.to_json()})
    answer = NodeClient(transport).pull(node_plan.run_dir, sources, timeout=PULL_TIMEOUT)
    if answer.failed_count:
        first = answer.failed[0] if answer.failed else {}
        raise NodeError(f"{answer.failed_count} file(s) of output/ could not be brought from the store (first: "
                        f"{first.get('path')}: {first.get('error')}); every file already in its run folder is kept "
                        f"as it was: check the bucket, then `launch --resume` again")
    return answer


PULL_TIMEOUT = 6 * 3600.0   # a checkpoint of hundreds of GB over the node's own link


def start_run(plan: LaunchPlan, rendered: list[RenderedNode], cluster: Cluster, files: list[sync.SyncFile],
              on_done: Callable[[NodeResult], None] | None = None, cancel: threading.Event | None = None,
              missing: dict[str, list[str]] | None = None,
              on_ready: Callable[[list[NodeResult]], None] | None = None) -> FanOut[NodeStart]:
    """Prepare every node, then start every node; one result per node. `missing` (from `survey`) saves asking
    each node again what its store lacks. When any node could not be prepared, or `cancel` was set meanwhile,
    no node starts (their results say why); otherwise `on_ready` hears of the prepared nodes first."""
    cancel = cancel or threading.Event()
    by_name = {r.node: r for r in rendered}
    plans = {np.node.name: np for np in plan.nodes}
    nodes = [np.node for np in plan.nodes]
    missing = missing or {}
    prepared = cluster.fan_out(lambda t: prepare_node(t, plan, plans[t.node.name], by_name[t.node.name], files,
                                                      cancel, missing.get(t.node.name)), nodes)
    failed = prepared.failed
    if failed or cancel.is_set():
        why = "interrupted" if cancel.is_set() else f"{failed[0].node.name} could not be prepared"
        return FanOut(r if not r.ok else NodeResult.failed(r.node, f"not started: {why}") for r in prepared)
    if plan.attempt and any(np.node.outputs is not None for np in plan.nodes):
        # a resumed (or restarted) run with a bucket: each node takes its outputs back from it (fresh nodes that
        # never saw the run included), and what node 0 stored that it lacks
        pulled = cluster.fan_out(lambda t: pull_outputs(t, plan, plans[t.node.name]),
                                 [np.node for np in plan.nodes if np.node.outputs is not None])
        unpulled = pulled.failed
        if unpulled or cancel.is_set():
            why = "interrupted" if cancel.is_set() else \
                f"{unpulled[0].node.name} could not take the run's outputs from the store: {unpulled[0].reason}"
            return FanOut(NodeResult.failed(r.node, f"not started: {why}") for r in prepared)
    elif plan.attempt and not plan.builtin_trainer and plan.nnodes > 1:
        # a resumed (or restarted) script: its $NODECTL_OUTPUT_DIR on every node holds node 0's outputs too
        shared = share_output(cluster, plan.nodes[0], list(plan.nodes[1:]))
        unshared = shared.failed
        if unshared or cancel.is_set():
            why = "interrupted" if cancel.is_set() else \
                f"node 0's output/ could not be shared with {unshared[0].node.name}: {unshared[0].reason}"
            return FanOut(NodeResult.failed(r.node, f"not started: {why}") for r in prepared)
    counts = prepared.succeeded
    if on_ready is not None:
        on_ready(prepared)

    def start(transport: Transport) -> NodeStart:
        started = NodeClient(transport).start(plans[transport.node.name].run_dir)
        ready = counts[transport.node.name]
        return NodeStart(transport.node.name, started.pgid, ready.files, ready.sent)

    return cluster.fan_out(start, nodes, on_done=on_done)
