"""LaunchPlan: everything a launch will do, decided before any node is touched (torchx's dryrun, then act)."""
from __future__ import annotations

import hashlib
import json
import os
import random
import secrets
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Mapping

from nodectl.errors import UsageError
from nodectl.inventory import ENV_NAME_RE, MAX_RANKS_PER_NODE, Inventory, Node, node_from_record
from nodectl.outputs import Outputs, from_record as outputs_from_record
from nodectl.probe_report import ProbeReport
from nodectl.resources import NODE_TRAINER
from nodectl.resources.launchers.ports import LOWEST, ephemeral_range, quiet_port

# Good distributed defaults (docs/REFERENCE.md §4); the inventory's env: overrides any of them.
DEFAULT_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "PYTHONUNBUFFERED": "1",
    "PYTHONFAULTHANDLER": "1",
    "NODECTL_PACE_EVERY": "5",          # the ranks' pace files (lib/sitecustomize.py), for the straggler verdict
    "TORCH_NCCL_ENABLE_TIMING": "1",    # and on NCCL how long each collective took (its CUDA events)
}   # HF_HUB_OFFLINE=1 is the built-in trainer's own default (trainer/__main__.py), not forced on a user's script


@dataclass(frozen=True)
class NodePlan:
    node: Node
    node_rank: int
    nproc: int
    run_dir: str                 # on the node; may start with ~/
    env: Mapping[str, str]

    @property
    def ranks(self) -> list[int]:
        return list(range(self.node_rank * self.nproc, (self.node_rank + 1) * self.nproc))


@dataclass(frozen=True)
class LaunchPlan:
    run_id: str
    nodes: tuple[NodePlan, ...]
    backend: str
    master_addr: str
    master_port: int
    port_was_chosen: bool        # True when nodectl picked the port (may move it if taken)
    command: tuple[str, ...]     # what follows rankexec.py: SCRIPT ARGS... or -m MODULE ARGS...
    sync_dir: str
    builtin_trainer: bool
    config: str | None
    attempt: int = 0
    overrides: tuple[str, ...] = ()  # the built-in trainer's --set section.key=value, in order
    created: float = field(default_factory=time.time)
    outputs: Outputs | None = None   # node 0's bucket (each node's own is its node's `outputs`): what is shown

    @property
    def nnodes(self) -> int:
        return len(self.nodes)

    @property
    def world_size(self) -> int:
        return sum(n.nproc for n in self.nodes)

    def node_of_rank(self, rank: int) -> NodePlan:
        for node_plan in self.nodes:
            if rank in node_plan.ranks:
                return node_plan
        raise UsageError(f"rank{rank} is not in run {self.run_id} (world size {self.world_size})")

    def fingerprint(self) -> str:
        """What makes two launches the same job: command, config content, nodes and their settings."""
        config_text = Path(self.config).read_text() if self.config and Path(self.config).is_file() else None
        identity = {"command": self.command, "config": config_text, "backend": self.backend,
                    "nodes": [{"host": n.node.host, "nproc": n.nproc, "env": dict(n.env)} for n in self.nodes]}
        for entry in identity["nodes"]:
            entry["env"] = {k: v for k, v in entry["env"].items() if not k.startswith("NODECTL_RUN")}
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]

    def to_json(self) -> dict:
        from nodectl.secrets import redact_args, redact_env, redact_text

        data = asdict(self)
        data["command"] = redact_args(data["command"])
        data["overrides"] = redact_args(data["overrides"])
        for entry in data["nodes"]:
            entry["env"] = redact_env(entry["env"])
            entry["node"]["env"] = redact_env(entry["node"]["env"])
            if entry["node"].get("container"):   # `-e NAME=secret` among the runtime's options, credentials in mounts
                container = entry["node"]["container"]
                container["options"] = redact_args(container.get("options") or [])
                container["mounts"] = [redact_text(m) for m in container.get("mounts") or []]
            if entry["node"].get("environment"):   # the file's text may name an index with its credentials
                entry["node"]["environment"].pop("requirements", None)
                if entry["node"]["environment"].get("index_url"):   # user:password@ in the URL is not recorded
                    entry["node"]["environment"]["index_url"] = redact_text(entry["node"]["environment"]["index_url"])
            entry["ranks"] = list(range(entry["node_rank"] * entry["nproc"], (entry["node_rank"] + 1) * entry["nproc"]))
        return data

    @classmethod
    def from_json(cls, data, source: str = "the run record") -> "LaunchPlan":
        """A recorded plan (`to_json`'s, in a manifest) read back as one, checked as the inventory is: a record is
        data a person or another program may have written, so every field is taken only with its type and
        range, every node through the inventory's own rules (node_from_record), and anything else is a
        UsageError naming the field. Its env values are the redacted ones recorded."""
        def fail(key: str, expected: str):
            raise UsageError(f"{source}: plan.{key}: expected {expected}")

        def take(key: str, kind, expected: str, where=None, optional: bool = False):
            value = (where if where is not None else data).get(key)
            if value is None and optional:
                return None
            if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
                fail(key, expected)
            return value

        def words(key: str) -> tuple[str, ...]:
            value = data.get(key) or []
            if not isinstance(value, list) or not all(isinstance(word, str) for word in value):
                fail(key, "a list of strings")
            return tuple(value)

        if not isinstance(data, Mapping):
            raise UsageError(f"{source}: the plan is not a mapping")
        entries = take("nodes", list, "a list of nodes")
        if not entries:
            fail("nodes", "at least one node")
        nodes = []
        for index, entry in enumerate(entries):
            if not isinstance(entry, Mapping):
                fail(f"nodes[{index}]", "a mapping")
            nproc = take("nproc", int, f"an integer 1-{MAX_RANKS_PER_NODE}", entry)
            if not 1 <= nproc <= MAX_RANKS_PER_NODE or take("node_rank", int, "an integer", entry) != index:
                fail(f"nodes[{index}]", f"node_rank {index} and nproc 1-{MAX_RANKS_PER_NODE}")
            env = take("env", Mapping, "a mapping of variables", entry)
            if not all(isinstance(k, str) and ENV_NAME_RE.match(k) and isinstance(v, str) for k, v in env.items()):
                fail(f"nodes[{index}].env", "variable names with string values")
            node = node_from_record(take("node", Mapping, "a node", entry), source)
            nodes.append(NodePlan(node, index, nproc, take("run_dir", str, "a path", entry), dict(env)))
        port = take("master_port", int, "a port 1-65535")
        if not 1 <= port <= 65535:
            fail("master_port", "a port 1-65535")
        backend = take("backend", str, "nccl or gloo")
        if backend not in ("nccl", "gloo"):
            fail("backend", "nccl or gloo")
        attempt = take("attempt", int, "an integer >= 0", optional=True) or 0
        if attempt < 0:
            fail("attempt", "an integer >= 0")
        return cls(run_id=take("run_id", str, "a run id"), nodes=tuple(nodes), backend=backend,
                   master_addr=take("master_addr", str, "an address"), master_port=port,
                   port_was_chosen=bool(take("port_was_chosen", bool, "true or false", optional=True)),
                   command=words("command"), sync_dir=take("sync_dir", str, "a path"),
                   builtin_trainer=take("builtin_trainer", bool, "true or false"),
                   config=take("config", str, "a path", optional=True), overrides=words("overrides"),
                   created=float(take("created", (int, float), "a time", optional=True) or 0.0),
                   outputs=outputs_from_record(data.get("outputs")), attempt=attempt)


def flight_recorder_env(run_dir: str, torch_version: str | None) -> dict[str, str]:
    """The NCCL flight recorder, under the names the node's torch reads (TORCH_FR_* from 2.7 on)."""
    major_minor = tuple(int(x) for x in (torch_version or "9.9").split("+")[0].split(".")[:2] if x.isdigit())
    if major_minor and major_minor < (2, 7):
        return {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{run_dir}/flight/rank_"}
    return {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_FR_DUMP_TEMP_FILE": f"{run_dir}/flight/rank_"}


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def _pick_port(inventory: Inventory) -> tuple[int, bool]:
    if inventory.master_port:
        return inventory.master_port, False
    if inventory.nodes[0].is_local:
        return quiet_port(), True
    low, _ = ephemeral_range()       # the controller's range: a guess for node 0's, which settle_master_port checks
    return random.randint(LOWEST, max(LOWEST + 1000, low - 1)), True


def _run_dir(node: Node, run_id: str, shared: bool) -> str:
    base = f"{node.workdir.rstrip('/')}/runs/{run_id}"
    return f"{base}/{node.name}" if shared else base


def _cuda_devices(plan_nodes: list[tuple[Node, int]], visible: str | None) -> dict[str, str]:
    """Several local 'nodes' on one machine each get their own GPUs, in node order, drawn from the GPUs this
    process may use (CUDA_VISIBLE_DEVICES when set, else 0, 1, ...)."""
    pool = [d.strip() for d in visible.split(",") if d.strip()] if visible else None
    assignment, next_gpu = {}, 0
    for node, nproc in plan_nodes:
        if node.is_local and node.device == "cuda" and "CUDA_VISIBLE_DEVICES" not in node.env:
            wanted = range(next_gpu, next_gpu + nproc)
            ids = pool[wanted.start:wanted.stop] if pool is not None else [str(g) for g in wanted]
            if len(ids) < nproc:
                raise UsageError(f"local nodes need {next_gpu + nproc} GPUs; CUDA_VISIBLE_DEVICES={visible} offers "
                                 f"{len(pool)}")
            assignment[node.name] = ",".join(ids)
            next_gpu += nproc
    return assignment if len(assignment) > 1 else {}


def _probed_gpus(node: Node, report: ProbeReport) -> int | None:
    """A cuda node without `gpus:` (and no --gpus) runs one rank per GPU its probe saw (CUDA_VISIBLE_DEVICES
    applied), as the inventory promises; without a probe report (--skip-preflight) it runs one."""
    count = report.gpus.count if node.device == "cuda" else None
    return count if count is not None and count > 0 else None


def _this_machine() -> tuple[str | None, frozenset[int]]:
    """The controller's kernel boot id and the CPUs it may use: a local node's, when no probe has read it."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="utf-8") as handle:
            boot = handle.read().strip() or None
    except OSError:
        boot = None
    return boot, frozenset(os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1))


def threads_per_rank(per_node: list[tuple[Node, int]], reports: Mapping[str, ProbeReport]) -> dict[str, int]:
    """OMP_NUM_THREADS for each node whose CPUs are known: its CPUs over the ranks that run on them, counting the
    ranks of the plan's other nodes on the same kernel (one boot id) whose CPU sets meet its own. Local "nodes",
    containers or namespaces of one machine would otherwise each start a thread per core: on 2 cores, two local
    nodes' ranks spun 84 CPU-s through a 45 s demo that takes 12 s at one thread each."""
    machines: dict[str, tuple[str | None, frozenset[int], int]] = {}
    for node, nproc in per_node:
        cpu = reports[node.name].cpu if node.name in reports else None
        if cpu is not None and cpu.available:
            cpus = frozenset(cpu.cpu_set or ()) or frozenset(range(cpu.available))
            machines[node.name] = (cpu.boot_id if cpu.cpu_set else None, cpus, nproc)
        elif node.is_local:
            boot, cpus = _this_machine()
            machines[node.name] = (boot, cpus, nproc)
    threads = {}
    for name, (boot, cpus, nproc) in machines.items():
        ranks = nproc + sum(other_nproc for other, (other_boot, other_cpus, other_nproc) in machines.items()
                            if other != name and boot is not None and other_boot == boot and cpus & other_cpus)
        threads[name] = max(1, len(cpus) // ranks)
    return threads


def visible_devices(inventory: Inventory, gpus: int | None) -> dict[str, str]:
    """The CUDA_VISIBLE_DEVICES each node's ranks will get, where one is set: the inventory's env:, or the share
    of this machine's GPUs a local node is given (preflight probes with it, so it judges those GPUs only)."""
    shares = _cuda_devices([(n, gpus or n.gpus or 1) for n in inventory.nodes],
                           os.environ.get("CUDA_VISIBLE_DEVICES"))
    return {n.name: n.env.get("CUDA_VISIBLE_DEVICES", shares.get(n.name)) for n in inventory.nodes
            if n.device == "cuda" and (n.env.get("CUDA_VISIBLE_DEVICES") is not None or n.name in shares)}


def build_plan(inventory: Inventory, *, gpus: int | None, command: tuple[str, ...], sync_dir: str,
               config: str | None = None, run_id: str | None = None,
               overrides: tuple[str, ...] = (),
               facts: Mapping[str, dict] | None = None, shared_workdirs: frozenset[str] = frozenset()) -> LaunchPlan:
    """Decide ranks, addresses, ports, folders and environments. Reads no node (only this process's
    CUDA_VISIBLE_DEVICES, for local nodes); `facts` are probe reports from the preflight that just ran, when
    there was one (CPU count, torch version). Nodes in `shared_workdirs` share their workdir's storage with
    another node (an NFS home), so each gets a run folder of its own below the run's."""
    reports = {name: ProbeReport.of(report) for name, report in (facts or {}).items()}
    unknown = ProbeReport.of({})   # a node without a report (--skip-preflight)
    nodes = inventory.nodes
    devices = {n.device for n in nodes}
    if len(devices) > 1:
        raise UsageError("nodes mix device: cuda and device: cpu; one run uses one backend")
    run_id = run_id or new_run_id()
    builtin = not command
    if builtin:
        # The recipe travels with the run (config/<name> in the run folder; ranks start in code/): the
        # controller's path means nothing on a node.
        command = ("-m", NODE_TRAINER, *(("--config", f"../config/{Path(config).name}") if config else ()),
                   *(word for assignment in overrides for word in ("--set", assignment)))
    per_node = [(n, gpus or n.gpus or _probed_gpus(n, reports.get(n.name, unknown)) or 1) for n in nodes]
    homes = [(n.host, n.port, n.user, n.workdir) for n in nodes]
    port, chosen = _pick_port(inventory)
    gpu_sets = _cuda_devices(per_node, os.environ.get("CUDA_VISIBLE_DEVICES"))
    threads = threads_per_rank(per_node, reports)
    node_plans = []
    for node_rank, (node, nproc) in enumerate(per_node):
        shared = node.name in shared_workdirs or homes.count((node.host, node.port, node.user, node.workdir)) > 1
        run_dir = _run_dir(node, run_id, shared)
        report = reports.get(node.name, unknown)
        env = {**DEFAULT_ENV, "NODECTL_RUN_ID": run_id, "NODECTL_RUN_DIR": run_dir,
               "NODECTL_OUTPUT_DIR": f"{run_dir}/output",
               "NODECTL_NODE_RANK": str(node_rank), "NODECTL_NNODES": str(len(nodes)),
               **flight_recorder_env(run_dir, report.torch.version)}
        if node.name in threads:
            env["OMP_NUM_THREADS"] = str(threads[node.name])
        if node.name in gpu_sets:
            env["CUDA_VISIBLE_DEVICES"] = gpu_sets[node.name]
        if builtin:
            env["PYTHONPATH"] = f"{run_dir}/lib"
        env.update(node.env)
        node_plans.append(NodePlan(node=node, node_rank=node_rank, nproc=nproc, run_dir=run_dir, env=env))
    return LaunchPlan(run_id=run_id, nodes=tuple(node_plans), backend="gloo" if devices == {"cpu"} else "nccl",
                      master_addr=nodes[0].addr, master_port=port, port_was_chosen=chosen, command=tuple(command),
                      sync_dir=os.path.abspath(sync_dir), builtin_trainer=builtin, config=config,
                      overrides=tuple(overrides), outputs=inventory.outputs)


def with_port(plan: LaunchPlan, port: int) -> LaunchPlan:
    return replace(plan, master_port=port)
