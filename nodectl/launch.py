"""Acting on a LaunchPlan: port check, code sync, per-node run folders, and the detached start on every node."""
from __future__ import annotations

import json
from dataclasses import dataclass

from nodectl import agent, sync
from nodectl.errors import NodectlError, UnreachableError
from nodectl.plan import LaunchPlan, NodePlan, with_port
from nodectl.render import RenderedNode
from nodectl.transport import Cluster, Transport


@dataclass(frozen=True)
class NodeStart:
    node: str
    pgid: int
    files: int
    bytes_sent: int


def settle_master_port(plan: LaunchPlan, cluster: Cluster) -> LaunchPlan:
    """Make sure node 0 can listen on the master port; move a port nodectl chose if it is taken."""
    master = plan.nodes[0].node
    results = cluster.fan_out(lambda t: agent.call(t, "port", str(plan.master_port)), [master])
    answer = results[0]
    if answer.unreachable:
        raise UnreachableError(f"{master.name}: {answer.error}")
    if answer.value["free"]:
        return plan
    if plan.port_was_chosen:
        return with_port(plan, answer.value["port"])
    raise NodectlError(f"master_port {plan.master_port} is in use on {master.name}; stop what holds it or pick "
                       f"another master_port in the inventory")


def _node_json(plan: LaunchPlan, node_plan: NodePlan) -> str:
    return json.dumps({"run_id": plan.run_id, "node_rank": node_plan.node_rank, "nproc": node_plan.nproc,
                       "ranks": node_plan.ranks, "nnodes": plan.nnodes, "node": node_plan.node.name,
                       "attempt": plan.attempt})


def start_node(transport: Transport, plan: LaunchPlan, node_plan: NodePlan, rendered: RenderedNode,
               files: list[sync.SyncFile]) -> NodeStart:
    upload, sent = sync.upload_missing(transport, files)
    request = {
        "workdir": node_plan.node.workdir, "run_dir": node_plan.run_dir, "upload": upload,
        "new_attempt": plan.attempt > 0,
        "files": [f.entry() for f in files],
        "rendered": {"launch.sh": {"text": rendered.launch, "mode": 0o700},
                     "env.sh": {"text": rendered.env, "mode": 0o600},
                     "node.json": {"text": _node_json(plan, node_plan), "mode": 0o644}},
    }
    prepared = agent.call(transport, "prepare", request=request)
    started = agent.call(transport, "start", node_plan.run_dir)
    return NodeStart(node_plan.node.name, started["pgid"], prepared["files"], sent)


def start_run(plan: LaunchPlan, rendered: list[RenderedNode], cluster: Cluster,
              files: list[sync.SyncFile], on_done=None) -> list:
    """Start every node in parallel. If any node fails to start, the ones that did are stopped again."""
    by_name = {r.node: r for r in rendered}
    plans = {np.node.name: np for np in plan.nodes}

    def work(transport: Transport) -> NodeStart:
        name = transport.node.name
        return start_node(transport, plan, plans[name], by_name[name], files)

    def guarded(transport: Transport):
        try:
            return work(transport)
        except agent.AgentError as exc:
            raise _StartFailed(str(exc)) from None

    results = cluster.fan_out(_catching(guarded), [np.node for np in plan.nodes], on_done=on_done)
    return results


class _StartFailed(Exception):
    pass


def _catching(fn):
    def wrapper(transport):
        try:
            return fn(transport)
        except (_StartFailed, OSError) as exc:
            return exc
    return wrapper
