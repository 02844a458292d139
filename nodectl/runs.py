"""The local run folders (SPEC §3): runs/<run_id>/ with manifest.json, scripts/, env/, preflight.json, nodes/."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from nodectl import __version__
from nodectl.errors import UsageError
from nodectl.inventory import Node


FINAL_STATES = ("succeeded", "failed", "failed-to-start", "interrupted", "stopped", "lost")


def runs_root() -> Path:
    return Path(os.environ.get("NODECTL_RUNS", "runs"))


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
        folder = state_dir() / "runs"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{run.run_id}.json").write_text(json.dumps({"folder": str(run.folder.resolve())}) + "\n")
    except OSError:
        pass


def _registered() -> list[Path]:
    folder = state_dir() / "runs"
    found = []
    for entry in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            found.append(Path(json.loads(entry.read_text())["folder"]))
        except (OSError, ValueError, KeyError, TypeError):
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
            return json.loads(self.manifest_path.read_text()).get("kind", "train")
        except (OSError, ValueError):
            return "train"

    def manifest(self) -> dict:
        try:
            return json.loads(self.manifest_path.read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"run {self.run_id}: manifest unreadable ({exc})") from None

    def update(self, **fields) -> dict:
        document = self.manifest()
        document.update(fields)
        _write_json(self.manifest_path, document)
        return document

    def set_node_state(self, node: str, **fields) -> None:
        self.set_node_states({node: fields})

    def set_node_states(self, states: dict[str, dict], **fields) -> None:
        """Several nodes' states (and top-level fields) in one write of the manifest."""
        document = self.manifest()
        for node, values in states.items():
            document.setdefault("node_states", {}).setdefault(node, {}).update(values)
        document.update(fields)
        _write_json(self.manifest_path, document)

    def nodes(self, left_out: bool = False) -> list[RunNode]:
        """The nodes of the run's current attempt; with `left_out`, also those a restart left out (their
        processes may outlive the attempt that dropped them)."""
        manifest = self.manifest()
        out = []
        for entry in manifest["plan"]["nodes"] + (manifest.get("left_out", []) if left_out else []):
            node_fields = dict(entry["node"])
            node_fields["env"] = {}  # redacted in the manifest; not needed to reach the node
            out.append(RunNode(Node(**node_fields), entry["node_rank"], tuple(entry["ranks"]), entry["run_dir"]))
        return out

    def node_of_rank(self, rank: int) -> RunNode:
        for run_node in self.nodes():
            if rank in run_node.ranks:
                return run_node
        raise UsageError(f"rank{rank} is not part of run {self.run_id}")


def create_run(plan_json: dict, *, argv: list[str], config_fingerprint: str, inventory_source: str,
               git: str | None, kind: str = "train") -> Run:
    """Record a new run. `kind` "preflight" marks preflight's own collective jobs: they are never "the latest
    run" of tail/status/stop, and `runs` lists them only with --all."""
    run = Run(runs_root() / plan_json["run_id"])
    run.folder.mkdir(parents=True, exist_ok=False)
    _write_json(run.manifest_path, {
        "run_id": plan_json["run_id"], "kind": kind, "attempt": plan_json.get("attempt", 0), "state": "starting",
        "command": argv, "config": plan_json.get("config"), "fingerprint": config_fingerprint,
        "inventory": {"source": inventory_source, "nodes": [n["node"] for n in plan_json["nodes"]]},
        "git_revision": git, "nodectl_version": __version__, "python": sys.version.split()[0],
        "started": time.time(), "ended": None, "plan": plan_json, "node_states": {},
    })
    _register(run)
    return run


def _all_runs() -> list[Run]:
    """Runs under ./runs (or $NODECTL_RUNS) and every run in the registry, oldest first, each once."""
    root = runs_root()
    folders = [p for p in root.glob("*")] if root.is_dir() else []
    folders += _registered()
    unique = {}
    for folder in folders:
        if (folder / "manifest.json").is_file():
            unique.setdefault(folder.name, folder)
    return [Run(unique[name]) for name in sorted(unique)]  # run ids start with their start time


def open_run(run_id: str | None) -> Run:
    """A recorded run by id (a unique prefix works), or the latest one that is not a preflight job."""
    candidates = _all_runs()
    if run_id is None:
        users = [run for run in candidates if run.kind != "preflight"]
        if not users:
            raise UsageError(f"no runs recorded under {runs_root().resolve()}/ or in {state_dir() / 'runs'}/; "
                             f"start one with nodectl launch")
        return users[-1]
    matches = [r for r in candidates if r.run_id == run_id] or [r for r in candidates if r.run_id.startswith(run_id)]
    if len(matches) != 1:
        known = ", ".join(r.run_id for r in candidates if r.kind != "preflight")[-200:]
        raise UsageError(f"run {run_id!r} {'is ambiguous' if matches else 'not found'}; recent runs: {known or 'none'}")
    return matches[0]


def list_runs(include_preflight: bool = False) -> list[Run]:
    return [run for run in _all_runs() if include_preflight or run.kind != "preflight"]
