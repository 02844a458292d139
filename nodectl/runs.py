"""The local run folders (docs/REFERENCE.md, "Files on disk"): runs/<run_id>/ with manifest.json, scripts/, env/,
preflight.json, nodes/.

The manifest is a `Manifest`; `Run.update` is its one writer (read, replace fields, write atomically)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import MISSING, dataclass, field, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any

from nodectl import __version__
from nodectl.errors import NodectlError, UsageError
from nodectl.inventory import Node, node_from_record
from nodectl.outputs import from_record
from nodectl.plan import LaunchPlan


class RunState(str, Enum):
    """A run's state as the manifest records it (its JSON value is the string)."""

    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    FAILED_TO_START = "failed-to-start"
    INTERRUPTED = "interrupted"
    STOPPED = "stopped"
    LOST = "lost"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def final(self) -> bool:
        """No process of the run can be alive any more, as far as nodectl knows; only the nodes can change a
        state that is not final (a killed controller leaves "starting" or "running")."""
        return self not in (RunState.STARTING, RunState.RUNNING)

    @classmethod
    def parse(cls, value: Any) -> "RunState":
        """A recorded state; one this version does not know reads as "starting", which the nodes then settle."""
        try:
            return cls(value)
        except ValueError:
            return cls.STARTING


FINAL_STATES = frozenset(state for state in RunState if state.final)


@dataclass(frozen=True)
class Manifest:
    """runs/<run_id>/manifest.json. `plan` is the LaunchPlan, read back from its JSON (env redacted) through
    LaunchPlan.from_json's checks, whoever reads the record; `attempts` the earlier attempts of a restarted or
    resumed run; `left_out` the plan entries of nodes a restart left out. Keys this version does not know are kept
    in `extra` and written back."""

    run_id: str
    plan: LaunchPlan
    kind: str = "train"            # train, or preflight (preflight's own collective jobs)
    attempt: int = 0
    state: RunState = RunState.STARTING
    command: list = field(default_factory=list)
    config: str | None = None
    fingerprint: str | None = None
    inventory: dict = field(default_factory=dict)
    git_revision: str | None = None
    nodectl_version: str | None = None
    python: str | None = None
    started: float | None = None
    ended: float | None = None
    node_states: dict = field(default_factory=dict)
    failure: dict | None = None
    attempts: list = field(default_factory=list)
    left_out: list = field(default_factory=list)
    controller: dict | None = None  # the nodectl process that started this attempt: host, pid, its start time
    pace: dict | None = None        # the attached launch's latest pace verdict (nodectl/pace.py: PaceState)
    attending: dict | None = None   # how the attached launch watches the run (nodectl/launch/attending.py)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", RunState(self.state))  # a typo in nodectl's own code fails here

    @classmethod
    def from_json(cls, document: dict) -> "Manifest":
        if not isinstance(document, dict) or not isinstance(document.get("plan"), dict):
            raise ValueError("not a run manifest")
        known = {f.name: f for f in fields(cls) if f.name != "extra"}
        # a null where a list or mapping belongs reads as empty
        values = {key: document[key] for key, f in known.items()
                  if key in document and (document[key] is not None or f.default_factory is MISSING)}
        values.setdefault("run_id", document["plan"].get("run_id"))
        if "attending" not in document and document["plan"].get("max_restarts"):   # an older record: in its plan
            values["attending"] = {"max_restarts": document["plan"]["max_restarts"]}
        values["state"] = RunState.parse(document.get("state"))
        _check_shape(values, known)
        # a record is data anyone with write access to it may have crafted: every reader gets it only once its
        # plan and the nodes a restart left out pass the inventory's rules (a node named ../../.., a sync_dir)
        source = f"run {values.get('run_id')}'s record"
        values["plan"] = LaunchPlan.from_json(document["plan"], source)
        for index, entry in enumerate(values.get("left_out") or []):
            if not isinstance(entry, dict) or not isinstance(entry.get("node"), dict):
                raise UsageError(f"{source}: left_out[{index}]: expected a node's plan entry")
            node_from_record(entry["node"], source)
        return cls(**values, extra={k: v for k, v in document.items() if k not in known})

    def to_json(self) -> dict:
        document = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        document["state"] = self.state.value
        document["plan"] = self.plan.to_json()
        return {**document, **self.extra}

    @property
    def node_names(self) -> list[str]:
        return [np.node.name for np in self.plan.nodes]

    @property
    def outputs(self):
        """The bucket the run's nodes upload to (nodectl/outputs.py), checked as the inventory's is (a record
        whose entry is not one is refused whole); None when the run has none."""
        return self.plan.outputs

    @property
    def node_outputs(self) -> dict:
        """node name -> the bucket it uploaded to, for every node of the run (those a restart left out too) that
        had one; each checked as the inventory's is (a malformed entry counts as none)."""
        found = {np.node.name: np.node.outputs or self.outputs for np in self.plan.nodes
                 if (np.node.outputs or self.outputs) is not None}
        for entry in self.left_out:
            node = entry.get("node") if isinstance(entry, dict) else None
            if not isinstance(node, dict) or not isinstance(node.get("name"), str):
                continue
            try:   # a record of the first version holds the run's bucket only
                outputs = from_record(node.get("outputs")) or self.outputs
            except NodectlError:
                outputs = None
            if outputs is not None:
                found.setdefault(node["name"], outputs)
        return found

    @property
    def outputs_url(self) -> str | None:
        outputs = self.outputs
        return outputs.run_url(self.run_id) if outputs else None

    @property
    def cause(self) -> str | None:
        """How this attempt ended when it did not succeed, in the words launch, status and runs all use: the
        first cause nodectl saw (a rank that failed, a stall as its diagnosis names it, a lost node, Ctrl-C),
        never what its own stop then did to the other ranks. None where nothing was recorded."""
        failure = self.failure if isinstance(self.failure, dict) else {}
        description = failure.get("description")
        if isinstance(description, str) and description:
            return description
        return f"{failure['kind']} (no description recorded)" if isinstance(failure.get("kind"), str) else None


def _check_shape(values: dict, known: dict) -> None:
    """A manifest that parses as JSON but not as a run record (hand-edited, cut short, written by something else)
    is refused here with what is wrong, never later as a TypeError deep in a command."""
    if not isinstance(values.get("run_id"), str):
        raise ValueError("run_id is not a string")
    kinds = {list: list, dict: dict}
    for key, value in values.items():
        expected = known[key].default_factory if known[key].default_factory is not MISSING else None
        if expected in kinds and not isinstance(value, kinds[expected]):
            raise ValueError(f"{key} is not a {expected.__name__}")
    nodes = values["plan"].get("nodes", [])
    if not isinstance(nodes, list) or not all(
            isinstance(entry, dict) and isinstance(entry.get("node"), dict) and isinstance(entry["node"].get("name"), str)
            and isinstance(entry.get("nproc"), int) and isinstance(entry.get("node_rank"), int)
            and isinstance(entry.get("run_dir"), str) for entry in nodes):
        raise ValueError("plan.nodes is not a list of node plans")
    if not isinstance(values["plan"].get("command", []), list):
        raise ValueError("plan.command is not a list")


def runs_root() -> Path:
    return Path(os.environ.get("NODECTL_RUNS", "runs"))


def private_folder(path: Path) -> Path:
    """`path` created if need be and made 0700: run records hold commands, hosts and logs, and the controller's
    umask (often 022) would leave them readable by every user of the machine. Files nodectl writes are 0600 by
    the umask the CLI sets (nodectl/cli/__init__.py)."""
    path.mkdir(parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        path.chmod(0o700)
    return path


def state_dir() -> Path:
    """Where nodectl keeps what outlives a folder: $NODECTL_STATE_DIR, else $XDG_STATE_HOME/nodectl, else
    ~/.local/state/nodectl."""
    if os.environ.get("NODECTL_STATE_DIR"):
        return Path(os.environ["NODECTL_STATE_DIR"])
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "nodectl"


def _register(run: "Run") -> None:
    """One small file per run in the registry, naming its folder, so later commands find it from any folder.
    A registry that cannot be written costs only that convenience."""
    try:
        folder = private_folder(state_dir() / "runs")
        (folder / f"{run.run_id}.json").write_text(json.dumps({"folder": str(run.folder.resolve())}) + "\n")
    except OSError:
        pass


def _registered() -> list[Path]:
    folder = state_dir() / "runs"
    found = []
    for entry in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            found.append(Path(json.loads(entry.read_text())["folder"]))
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            continue
    return found


def _write_json(path: Path, document: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(document, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def git_revision(folder: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", folder, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", folder, "status", "--porcelain"], capture_output=True, text=True,
                               timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    return proc.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


@dataclass(frozen=True)
class RunNode:
    """What later commands need of one node of a recorded run."""

    node: Node
    node_rank: int
    ranks: tuple[int, ...]
    run_dir: str


class Run:
    """One local run folder and its manifest."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.manifest_path = folder / "manifest.json"

    @property
    def run_id(self) -> str:
        return self.folder.name

    @property
    def kind(self) -> str:
        try:
            return self.read().kind
        except UsageError:
            return "train"

    def read(self) -> Manifest:
        try:
            return Manifest.from_json(json.loads(self.manifest_path.read_text()))
        except (OSError, ValueError, TypeError, KeyError, RecursionError) as exc:
            raise UsageError(f"run {self.run_id}: manifest unreadable ({exc})") from None

    def update(self, **changes) -> Manifest:
        """The manifest's one writer: these fields replaced, written atomically."""
        manifest = replace(self.read(), **changes)
        _write_json(self.manifest_path, manifest.to_json())
        return manifest

    def set_node_states(self, states: dict[str, dict], **changes) -> Manifest:
        """Several nodes' states (and top-level fields) in one write of the manifest."""
        node_states = {name: dict(values) for name, values in self.read().node_states.items()}
        for node, values in states.items():
            node_states.setdefault(node, {}).update(values)
        return self.update(node_states=node_states, **changes)

    def nodes(self, left_out: bool = False) -> list[RunNode]:
        """The nodes of the run's current attempt; with `left_out`, also those a restart left out (their
        processes may outlive the attempt that dropped them)."""
        manifest = self.read()
        out = [RunNode(np.node, np.node_rank, tuple(np.ranks), np.run_dir) for np in manifest.plan.nodes]
        for entry in manifest.left_out if left_out else []:
            node = node_from_record(entry["node"], f"run {self.run_id}'s record ({self.manifest_path})")
            ranks = entry.get("ranks")
            if not isinstance(ranks, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
                raise UsageError(f"run {self.run_id}: manifest unreadable (node {node.name}'s ranks)")
            out.append(RunNode(node, entry["node_rank"], tuple(ranks), entry["run_dir"]))
        return out

    def node_of_rank(self, rank: int) -> RunNode:
        for run_node in self.nodes():
            if rank in run_node.ranks:
                return run_node
        raise UsageError(f"rank{rank} is not part of run {self.run_id}")


def create_run(plan: LaunchPlan, *, argv: list[str], config_fingerprint: str, inventory_source: str,
               git: str | None, kind: str = "train", attending: dict | None = None) -> Run:
    """Record a new run. `kind` "preflight" marks preflight's own collective jobs: they are never "the latest
    run" of tail/status/stop, and `runs` lists them only with --all. `attending`: how the attached launch
    watches it (nodectl/launch/attending.py), in the first write."""
    run = Run(private_folder(runs_root()) / plan.run_id)
    run.folder.mkdir(mode=0o700, exist_ok=False)
    manifest = Manifest(
        run_id=plan.run_id, kind=kind, attempt=plan.attempt, command=argv, config=plan.config,
        fingerprint=config_fingerprint,
        inventory={"source": inventory_source, "nodes": [entry["node"] for entry in plan.to_json()["nodes"]]},
        git_revision=git, nodectl_version=__version__, python=sys.version.split()[0], started=time.time(),
        plan=plan, controller=this_controller(), attending=attending)
    _write_json(run.manifest_path, manifest.to_json())
    _register(run)
    return run


def this_controller() -> dict:
    import psutil

    return {"host": socket.gethostname(), "pid": os.getpid(), "since": round(psutil.Process().create_time(), 2)}


def controller_gone(manifest: Manifest) -> bool:
    """True when the nodectl process that started the run's current attempt is known to have ended (killed, or
    its machine rebooted): recorded on this host, and no process with that pid and start time lives. False where
    it lives, or cannot be told (another host, an older manifest)."""
    import psutil

    recorded = manifest.controller or {}
    if recorded.get("host") != socket.gethostname() or not isinstance(recorded.get("pid"), int):
        return False
    try:
        return abs(psutil.Process(recorded["pid"]).create_time() - float(recorded.get("since", 0))) > 1.0
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError, TypeError):
        return True


def _all_runs() -> list[Run]:
    """The user's runs, oldest first, each once: those the registry names (every run nodectl records registers
    itself in the user's state folder, which only the user can write). A folder under ./runs (or
    $NODECTL_RUNS) that the registry does not name as this run's is no record of the user's: a cloned project
    can ship one (its python: and paths would be acted on), so it is never read (untrusted_records() names
    it)."""
    registered = {}
    for folder in _registered():
        if (folder / "manifest.json").is_file():
            registered.setdefault(folder.name, folder)
    return [Run(registered[name]) for name in sorted(registered)]  # run ids start with their start time


def untrusted_records() -> list[Path]:
    """Run folders under ./runs (or $NODECTL_RUNS) holding a manifest that nodectl did not record for this
    user: ignored, and said so."""
    root = runs_root()
    mine = {folder.resolve() for folder in _registered()}
    return sorted(folder for folder in (root.glob("*") if root.is_dir() else [])
                  if (folder / "manifest.json").is_file() and folder.resolve() not in mine)


def open_run(run_id: str | None) -> Run:
    """A recorded run by id (a unique prefix works), or the latest one that is not a preflight job: the latest of
    this project (./runs, or $NODECTL_RUNS) when it has any, else the latest of the registry (any folder)."""
    candidates = _all_runs()
    if run_id is None:
        users = [run for run in candidates if run.kind != "preflight"]
        here = runs_root().resolve()
        local = [run for run in users if run.folder.resolve().parent == here]
        if not users:
            raise UsageError(f"no runs recorded under {runs_root().resolve()}/ or in {state_dir() / 'runs'}/; "
                             f"start one with nodectl launch")
        return (local or users)[-1]
    matches = [r for r in candidates if r.run_id == run_id] or [r for r in candidates if r.run_id.startswith(run_id)]
    foreign = [folder for folder in untrusted_records() if folder.name == run_id]
    if not matches and foreign:
        raise UsageError(f"run {run_id}: the record at {foreign[0]} was not written by nodectl for this user (a "
                         f"cloned project's?), so nothing in it is used; launch the run again here")
    if len(matches) != 1:
        known = ", ".join([r.run_id for r in candidates if r.kind != "preflight"][-6:])
        raise UsageError(f"run {run_id!r} {'is ambiguous' if matches else 'not found'}; recent runs: {known or 'none'}")
    return matches[0]


def list_runs(include_preflight: bool = False) -> list[Run]:
    return [run for run in _all_runs() if include_preflight or run.kind != "preflight"]


def live_runs_on(host: str, port: int | None = None) -> list[Run]:
    """Recorded runs not known to have ended whose master is `host` (and, given `port`, on that master port):
    what may hold a port or GPUs there. From the records only; a run's nodes have the last word."""
    found = []
    for run in list_runs(include_preflight=True):
        try:
            manifest = run.read()
        except (UsageError, OSError, ValueError):
            continue
        if manifest.state.final:
            continue
        master = manifest.plan.nodes[0].node
        if host in (master.host, master.addr) and port in (None, manifest.plan.master_port):
            found.append(run)
    return found
