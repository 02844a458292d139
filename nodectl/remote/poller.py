"""Watching every node of a run at once, each at its own pace.

One thread per node asks its runctl for the run's state in a loop. A node whose commands hang while TCP stays
up (a login shell stuck on a hung NFS home) only ages its own answer: the others keep being polled every
interval, so a failure on a healthy node is seen within a second or two, and the hung node is declared lost
after the same grace as an unreachable one.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Callable

from nodectl.remote import agent
from nodectl.runs import RunNode
from nodectl.transport import Cluster, CommandTimeout, NodeErrorKind, NodeResult, failure_of
from nodectl.remote.client import NodeClient


@dataclass
class Answer:
    result: NodeResult
    at: float          # time.monotonic() when it came back
    seq: int
    sent: float = 0.0  # time.monotonic() when it was asked
    hung: bool = False  # the command timed out: the node is up but its commands hang


class Poller:
    def __init__(self, cluster: Cluster, run_nodes: list[RunNode], offsets: Callable[[], dict[int, int]],
                 interval: float, timeout: float, pace: Callable[[RunNode], tuple[dict, bool] | None] | None = None
                 ) -> None:
        """`pace(run_node)`: what to ask that node of its ranks' pace ({rank: since}, GPU detail or not), or
        None (nodectl/pace.py)."""
        self.cluster, self.run_nodes, self.offsets, self.pace = cluster, run_nodes, offsets, pace
        self.interval, self.timeout = interval, timeout
        self.started = time.monotonic()   # what a node that never answered is silent since (watch's lost check)
        self._answers: dict[str, Answer] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(rn,), daemon=True, name=f"poll-{rn.node.name}")
                         for rn in run_nodes]

    def __enter__(self) -> "Poller":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()  # a thread stuck on a hung node ends with its command's timeout; nobody waits for it

    def _loop(self, run_node: RunNode) -> None:
        transport, seq = self.cluster.transport(run_node.node), 0
        while not self._stop.is_set():
            began = time.monotonic()
            wanted = {str(r): o for r, o in self.offsets().items() if r in run_node.ranks}
            hung = False
            pace = self.pace(run_node) if self.pace else None
            try:
                value = NodeClient(transport).poll(run_node.run_dir, wanted, pace=pace[0] if pace else None,
                                                   gpu_detail=bool(pace and pace[1]), timeout=self.timeout)
                result = NodeResult(run_node.node, value=value)
            except agent.AgentError as exc:  # the node answered, with an error
                result = NodeResult(run_node.node, failure=failure_of(exc))
            except Exception as exc:  # Unreachable, CommandTimeout, a broken connection: this node's news only
                failure = failure_of(exc)
                result = NodeResult(run_node.node, failure=replace(failure, kind=NodeErrorKind.UNREACHABLE,
                                                                   message=failure.message or exc.__class__.__name__))
                hung = isinstance(exc, CommandTimeout)
            seq += 1
            with self._lock:
                self._answers[run_node.node.name] = Answer(result, time.monotonic(), seq, hung, began)
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - began)))

    def answers(self) -> dict[str, Answer]:
        with self._lock:
            return dict(self._answers)

