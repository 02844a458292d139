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


def runs_root() -> Path:
    return Path(os.environ.get("NODECTL_RUNS", "runs"))


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
        document = self.manifest()
        document.setdefault("node_states", {}).setdefault(node, {}).update(fields)
        _write_json(self.manifest_path, document)

    def nodes(self) -> list[RunNode]:
        plan = self.manifest()["plan"]
        out = []
        for entry in plan["nodes"]:
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
               git: str | None) -> Run:
    run = Run(runs_root() / plan_json["run_id"])
    run.folder.mkdir(parents=True, exist_ok=False)
    _write_json(run.manifest_path, {
        "run_id": plan_json["run_id"], "attempt": plan_json.get("attempt", 0), "state": "starting",
        "command": argv, "config": plan_json.get("config"), "fingerprint": config_fingerprint,
        "inventory": {"source": inventory_source, "nodes": [n["node"] for n in plan_json["nodes"]]},
        "git_revision": git, "nodectl_version": __version__, "python": sys.version.split()[0],
        "started": time.time(), "ended": None, "plan": plan_json, "node_states": {},
    })
    return run


def open_run(run_id: str | None) -> Run:
    """A recorded run by id (a unique prefix works), or the latest one."""
    root = runs_root()
    candidates = sorted(p for p in root.glob("*") if (p / "manifest.json").is_file()) if root.is_dir() else []
    if not candidates:
        raise UsageError(f"no runs recorded under {root.resolve()}/ (run nodectl from the folder you launched in, "
                         f"or set NODECTL_RUNS)")
    if run_id is None:
        return Run(candidates[-1])  # run ids start with their start time, so names sort by age
    matches = [p for p in candidates if p.name == run_id] or [p for p in candidates if p.name.startswith(run_id)]
    if len(matches) != 1:
        known = ", ".join(p.name for p in candidates[-5:])
        raise UsageError(f"run {run_id!r} {'is ambiguous' if matches else 'not found'}; recent runs: {known}")
    return Run(matches[0])


def list_runs() -> list[Run]:
    root = runs_root()
    return [Run(p) for p in sorted(root.glob("*")) if (p / "manifest.json").is_file()] if root.is_dir() else []
