"""Gathering a diagnosis: every node at once, every rank of it at once, within a bound; saved in the run folder.

Each node's runctl asks the listener inside each of its ranks (launchers/sitecustomize.py) for the stacks of
every thread and the flight recorder, samples the ranks' CPU use for a second, and answers with those, the
heartbeats and the last log lines (`runctl diagnose`). A node that does not answer within the bound is lost to
the diagnosis, which is itself a finding. What came back lands under runs/<id>/diagnosis/<time>/: one JSON per
node as it answered, each rank's stacks as text, and diagnosis.json with the verdict.
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from nodectl.diagnose.flight import read_recorder, read_threads
from nodectl.diagnose.verdicts import RankView, Verdict, judge
from nodectl.remote.answers import DiagnoseAnswer, RankDump
from nodectl.transport import Cluster, NodeResult
from nodectl.runs import Run, RunNode
from nodectl.secrets import redact_tree, redact_words
from nodectl.remote.client import NodeClient

LISTENER_WAIT = 5.0     # seconds a node waits for its ranks' listeners
NODE_TIMEOUT = 20.0     # seconds the controller waits for a node's whole answer


@dataclass(frozen=True)
class Diagnosis:
    run_id: str
    verdict: Verdict
    views: tuple[RankView, ...]
    folder: Path | None          # None for a run that had ended: nothing was kept
    seconds: float
    unreachable: tuple[str, ...] = ()
    gpus: dict = field(default_factory=dict)    # node -> [{"index", "util", ...}] where the node has GPUs

    def to_json(self) -> dict:
        return {"run_id": self.run_id, **self.verdict.to_json(), "folder": str(self.folder) if self.folder else None,
                "seconds": round(self.seconds, 2), "unreachable": list(self.unreachable),
                "ranks": [_rank_json(v) for v in self.views], "gpus": self.gpus}

    def gpu_lines(self) -> list[str]:
        return [f"{node}: GPU utilisation " + ", ".join(f"{g.get('util'):.0f}%" if g.get("util") is not None else "?"
                                                      for g in rows)
                for node, rows in sorted(self.gpus.items()) if rows]


def diagnose(run: Run, cluster: Cluster, *, lines: int = 20, on_done=None) -> Diagnosis:
    started = time.monotonic()
    run_nodes = run.nodes()
    by_name = {rn.node.name: rn for rn in run_nodes}
    results = cluster.fan_out(lambda t: NodeClient(t).diagnose(by_name[t.node.name].run_dir, LISTENER_WAIT, lines,
                                                               timeout=NODE_TIMEOUT),
                              [rn.node for rn in run_nodes], on_done=on_done)
    views = [view for result in results for view in rank_views(by_name[result.node.name], result, run.run_id)]
    shorten = code_path(run.run_id)
    verdict = judge(views, shorten)
    gpus = {name: [dataclasses.asdict(g) for g in answer.gpu_sample.gpus]
            for name, answer in results.succeeded.items() if answer.gpu_sample and answer.gpu_sample.gpus}
    # a run that ended has nothing of a hang to keep: no diagnosis folder for it
    folder = None if verdict.kind == "ended" else _folder(run)
    diagnosis = Diagnosis(run.run_id, verdict, tuple(sorted(views, key=lambda v: v.rank)), folder,
                          time.monotonic() - started, tuple(r.node.name for r in results.failed), gpus)
    if folder is not None:
        for result in results:
            _save_node(folder, result)
        _save_stacks(folder, diagnosis.views, shorten)
        (folder / "diagnosis.json").write_text(json.dumps(redact_tree(diagnosis.to_json()), indent=1))
    return diagnosis


def rank_views(rn: RunNode, result: NodeResult, run_id: str) -> list[RankView]:
    """The views of one node's ranks from its answer; a node that did not answer is lost with all its ranks."""
    if not result.ok:
        return [RankView(rank, rn.node.name, running=False, lost=_short(result.error)) for rank in rn.ranks]
    answer: DiagnoseAnswer = result.value
    views = []
    for rank in rn.ranks:
        dump: RankDump | None = answer.ranks.get(str(rank))
        if dump is None:
            views.append(RankView(rank, rn.node.name, running=False))
            continue
        views.append(view_of(dump, rn.node.name, answer.now))
    return views


def view_of(dump: RankDump, node: str, now: float) -> RankView:
    listener = dump.listener if isinstance(dump.listener, dict) else None
    when = listener.get("time") if listener else None
    return RankView(
        rank=dump.rank, node=node, running=dump.alive and dump.exit is None,
        exit_code=dump.exit.code if dump.exit else None,
        cpu=dump.cpu.percent if dump.cpu else None, main_state=dump.main_state,
        threads=read_threads(listener), stack_text=dump.stack.text if dump.stack else None,
        recorder=read_recorder(listener), heartbeat_age=dump.heartbeat_age, step=dump.step,
        log_tail=dump.log_tail, now=when if isinstance(when, (int, float)) else now,
        listener_error=dump.listener_error or (listener.get("error") if listener else None))


def code_path(run_id: str):
    """Paths as the user knows them: the synced project's files relative to it (train.py, not
    /home/u/.nodectl/runs/<id>/code/train.py), nodectl's helpers under lib/."""
    marker = f"/runs/{run_id}/"

    def shorten(path: str) -> str:
        if marker not in path:
            return path
        inside = path.split(marker, 1)[1]
        return inside.split("code/", 1)[1] if "code/" in inside else inside
    return shorten


def _folder(run: Run) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder = run.folder / "diagnosis" / stamp
    n = 1
    while folder.exists():
        n += 1
        folder = run.folder / "diagnosis" / f"{stamp}-{n}"
    folder.mkdir(parents=True, mode=0o700)
    return folder


def _save_node(folder: Path, result: NodeResult) -> None:
    document = dataclasses.asdict(result.value) if result.ok else {"error": result.error}
    (folder / f"{result.node.name}.json").write_text(json.dumps(redact_tree(json.loads(json.dumps(document, default=str))),
                                                                indent=1))


def _save_stacks(folder: Path, views, shorten) -> None:
    for v in views:
        text = stacks_text(v, shorten)
        if text:
            (folder / f"rank{v.rank}.txt").write_text(redact_words(text))


def stacks_text(view: RankView, shorten=lambda p: p) -> str:
    if view.threads:
        blocks = []
        for thread in view.threads:
            lines = [f"Thread {thread.name}{' (main)' if thread.main else ''}, innermost last:"]
            for frame in thread.frames:
                lines.append(f"  {shorten(frame.file)}:{frame.line} in {frame.function}")
                if frame.text:
                    lines.append(f"    {frame.text.strip()}")
            blocks.append("\n".join(lines))
        return "\n\n".join(blocks) + "\n"
    return view.stack_text or ""


def _rank_json(view: RankView) -> dict:
    frame = view.where()
    waits = view.waits()
    return {"rank": view.rank, "node": view.node, "running": view.running, "exit_code": view.exit_code,
            "lost": view.lost, "cpu_percent": view.cpu, "main_state": view.main_state,
            "heartbeat_age": view.heartbeat_age, "step": view.step if isinstance(view.step, (int, float, str))
            else None,
            "at": {"file": frame.file, "line": frame.line, "function": frame.function} if frame else None,
            "waits_in": {"group": waits[0].group, "seq": waits[0].seq, "op": waits[0].op, "state": waits[0].state,
                         "backend": waits[0].backend, "seconds": round(view.age(waits[0]), 1)} if waits else None,
            "last_completed": view.recorder.last_completed, "last_enqueued": view.recorder.last_enqueued,
            "flight_recorder": list(view.recorder.versions), "listener_error": view.listener_error}


def _short(text: str) -> str:
    first = (text or "no answer").strip().splitlines()[0]
    return first[:200]
