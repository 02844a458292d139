"""The node client: every call nodectl makes to a node's runctl, one method per verb, each returning its typed
answer (nodectl/remote/answers.py) or raising one typed failure, a NodeError whose `kind` says which (unreachable
and timeout from the transport; exited, answered, malformed, no_run, unsafe from runctl). How a call reaches
runctl (installed once per version, checked before each call) is agent.py's."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from nodectl.remote import agent
from nodectl.secrets import redact_words
from nodectl.remote.answers import (ConnectAnswer, ContainerAnswer, DiagnoseAnswer, Done, EnvAnswer, FillAnswer,
                                    HaveAnswer, IdentityAnswer, ListenAnswer, PackAnswer, PollAnswer, PortAnswer,
                                    PrepareAnswer, PullAnswer, ReceiveAnswer, RouteAnswer, StacksAnswer, StartAnswer,
                                    StopAnswer, TailAnswer)
from nodectl.transport import CommandResult, StreamSink, Transport

Produce = Callable[[StreamSink], None]


class NodeClient:
    """One node's runctl, over the transport a fan-out hands its work (`NodeClient(transport).poll(...)`)."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    @property
    def workdir(self) -> str:
        return self.transport.node.workdir

    # --- the node and its store -------------------------------------------------------------------------------

    def identity(self, have: dict | None = None) -> IdentityAnswer:
        """Which storage the workdir is (shared workdirs); with `have`, which objects the store lacks."""
        return agent.call(self.transport, "identity", self.workdir, request=have)

    def have(self, request: dict) -> HaveAnswer:
        return agent.call(self.transport, "have", self.workdir, request=request)

    def receive(self, produce: Produce, prepare: dict | None = None) -> ReceiveAnswer:
        """Objects streamed into the store (a tar from `produce`); with `prepare`, the run folder laid out too."""
        return agent.call_stream(self.transport, "receive", self.workdir, produce=produce,
                                 request={"prepare": prepare} if prepare else None)

    def env_status(self, lock_sha: str) -> EnvAnswer:
        return agent.call(self.transport, "env_status", self.workdir, request={"lock_sha": lock_sha})

    def env_build(self, request: dict, timeout: float) -> EnvAnswer:
        return agent.call(self.transport, "env_build", self.workdir, request=request, timeout=timeout)

    def container(self, request: dict, timeout: float) -> ContainerAnswer:
        return agent.call(self.transport, "container", request=request, timeout=timeout)

    # --- the network, for preflight and the master port ---------------------------------------------------------

    def port(self, port: int) -> PortAnswer:
        """Whether `port` is free here (0: any free one)."""
        return agent.call(self.transport, "port", str(port))

    def listen(self, port: int, seconds: int, ephemeral: bool = False, expect: int = 0) -> ListenAnswer:
        """A listener on `port` (0: none) and, with `ephemeral`, on a port from the kernel's ephemeral range; with
        `expect`, it ends by itself once it has accepted that many connections."""
        request = {"ephemeral": True} if ephemeral else {}
        if expect:
            request["expect"] = expect
        return agent.call(self.transport, "listen", str(port), str(seconds), request=request or None)

    def unlisten(self, pid: int) -> Done:
        return agent.call(self.transport, "unlisten", str(pid))

    def connect(self, addr: str, port: int) -> ConnectAnswer:
        return agent.call(self.transport, "connect", addr, str(port))

    def route(self, addr: str, peers: tuple[str, ...] = (), connect: int | None = None,
              peer_ports: dict[str, int] | None = None, resolve: str | None = None) -> RouteAnswer:
        """The interface toward `addr` (and each of `peers`); with `connect`, a TCP connection to addr:connect
        first, in the same call (its answer in `reach`); with `peer_ports` ({address: port}), a connection to each
        (`peer_reach`); with `resolve`, that name's addresses here (`resolved`) and its /etc/hosts line."""
        request: dict = {"peers": list(peers)} if peers else {}
        if connect is not None:
            request["connect"] = {"host": addr, "port": connect}
        if peer_ports:
            request["peer_ports"] = dict(peer_ports)
        if resolve:
            request["resolve"] = resolve
        return agent.call(self.transport, "route", addr, request=request or None)

    # --- a run -------------------------------------------------------------------------------------------------

    def prepare(self, request: dict) -> PrepareAnswer:
        return agent.call(self.transport, "prepare", request=request)

    def pull(self, run_dir: str, sources: list[dict], timeout: float) -> PullAnswer:
        return agent.call(self.transport, "pull", run_dir, request={"sources": sources}, timeout=timeout)

    def start(self, run_dir: str) -> StartAnswer:
        return agent.call(self.transport, "start", run_dir)

    def poll(self, run_dir: str, offsets: dict[str, int], gpus: bool = False, pace: dict[str, int] | None = None,
             gpu_detail: bool = False, timeout: float = 30, checkpoint: bool = False,
             hardware: bool = False) -> PollAnswer:
        """The run's state on this node; with `pace` ({rank: ns}), each rank's collectives reached since then
        and what can slow it (with `gpu_detail`, its GPUs' other processes, clock reasons and links too); with
        `checkpoint`, the step of the built-in trainer's newest complete checkpoint there."""
        request = {"offsets": offsets, **({"gpus": True} if gpus else {}),
                   **({"pace": pace, "gpu_detail": gpu_detail} if pace is not None else {}),
                   **({"checkpoint": True} if checkpoint else {}), **({"hardware": True} if hardware else {})}
        return agent.call(self.transport, "poll", run_dir, request=request, timeout=timeout)

    def watch(self, run_dir: str, request: dict) -> agent.Watching:
        """The run's state on this node as a stream of poll answers, one per `interval` seconds of the request
        (its `offsets`, `pace`, `gpus` and `gpu_detail` as poll's), from one long-lived process on the node."""
        return agent.Watching(self.transport, run_dir, request)

    def tail(self, run_dir: str, ranks: list, lines: int, timeout: float = 30) -> TailAnswer:
        return agent.call(self.transport, "tail", run_dir, request={"ranks": ranks, "lines": lines}, timeout=timeout)

    def stop(self, run_dir: str, grace: float, unstarted: bool, timeout: float) -> StopAnswer:
        return agent.call(self.transport, "stop", run_dir, request={"grace": grace, "unstarted": unstarted},
                          timeout=timeout)

    def stacks(self, run_dir: str, timeout: float = 120) -> StacksAnswer:
        """Every rank's stack, its source lines masked as diagnose masks them (a token in a line of the program
        is never printed nor saved)."""
        answer = agent.call(self.transport, "stacks", run_dir, timeout=timeout)
        return replace(answer, stacks={rank: replace(entry, text=entry.text and redact_words(entry.text))
                                       for rank, entry in answer.stacks.items()})

    def diagnose(self, run_dir: str, wait: float, lines: int, timeout: float) -> DiagnoseAnswer:
        return agent.call(self.transport, "diagnose", run_dir, request={"wait": wait, "lines": lines},
                          timeout=timeout)

    def pack(self, run_dir: str, *, also: tuple[str, ...] = (), only: tuple[str, ...] = (),
             timeout: float = 600) -> PackAnswer:
        request = {"only": list(only)} if only else {"also": list(also)}
        return agent.call(self.transport, "pack", run_dir, request=request, timeout=timeout)

    def fill(self, run_dir: str, produce: Produce, timeout: float = 600) -> FillAnswer:
        return agent.call_stream(self.transport, "fill", run_dir, produce=produce, timeout=timeout)

    def cleanup(self, archive: str) -> Done:
        return agent.call(self.transport, "cleanup", archive)

    # --- launchers that need the ranks' interpreter ----------------------------------------------------------------

    def script(self, command: str, stdin: str | bytes, timeout: float) -> tuple[CommandResult, dict | None]:
        """A launcher sent on stdin and run by `command` under the node's own python with its site-packages (the
        probe, the GPU job, the bucket check: they import torch, CUDA or boto3, which runctl's `python -S` does
        not see): how it ended, and its answer read as runctl's are (agent.last_json), None when it gave none."""
        result = self.transport.run(command, stdin=stdin, timeout=timeout)
        return result, agent.last_json(result.stdout)
