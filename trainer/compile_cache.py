"""The compiler's work kept with the run (model.compile): torch's portable cache artifacts
(torch.compiler.save_cache_artifacts, torch >= 2.7: Inductor's compiled graphs, AOTAutograd's, Triton's kernels,
autotuning) saved by each node's first rank once the first step has compiled, into the node's output folder and into
every checkpoint written after that, and loaded before the first step of a later attempt, of a resume, or on a node
that joins the run with a checkpoint it was sent. Loading only fills torch's own local caches, so a graph whose key
differs (another torch, GPU or model) compiles as before; a file that cannot be read costs the cache, never the run.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch

FILE = "compile-cache.bin"
ABOUT = "compile-cache.json"   # beside it: the torch and device it was made with, and what it holds


def available() -> bool:
    return hasattr(torch.compiler, "save_cache_artifacts") and hasattr(torch.compiler, "load_cache_artifacts")


def _made_on(device: torch.device) -> dict:
    return {"torch": torch.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}


def _counts() -> dict:
    from torch._dynamo.utils import counters

    inductor, aot = counters["inductor"], counters["aot_autograd"]
    return {"graphs_found": inductor["fxgraph_cache_hit"] + aot["autograd_cache_hit"],
            "graphs_compiled": inductor["fxgraph_cache_miss"] + aot["autograd_cache_miss"]}


def load(sources: list[Path], device: torch.device) -> str | None:
    """Load the first cache file of `sources` (folders: the checkpoint resumed from, then the output folder) made
    with this torch on this kind of device. Returns what to say, or None where there is none."""
    if not available():
        return None
    for folder in sources:
        path = folder / FILE
        if not path.is_file():
            continue
        try:
            about = json.loads((folder / ABOUT).read_text())
            made = about.get("made_on") if isinstance(about, dict) else None
            if made != _made_on(device):
                return f"compile cache in {folder} not used: made with {made}, this rank has {_made_on(device)}"
            began = time.perf_counter()
            info = torch.compiler.load_cache_artifacts(path.read_bytes())
        except (OSError, ValueError, RuntimeError, AssertionError, EOFError) as exc:
            return f"compile cache in {folder} not used: {type(exc).__name__}: {exc}".splitlines()[0]
        held = sum(len(v) for v in getattr(info, "artifacts", {}).values()) if info is not None else 0
        if not held:
            return f"compile cache in {folder} not used: it holds nothing this torch reads ({path.stat().st_size} B)"
        return f"compile cache: {held} artifact(s) loaded from {folder} in {time.perf_counter() - began:.1f}s"
    return None


def save(out_dir: Path, device: torch.device) -> str | None:
    """After the first step: what this process compiled or found, written into `out_dir` (a file swapped in whole).
    Returns what to say, or None where torch has nothing to save."""
    if not available():
        return None
    counts = _counts()
    try:
        saved = torch.compiler.save_cache_artifacts()
    except (RuntimeError, AssertionError, OSError) as exc:
        return f"compile cache not saved: {type(exc).__name__}: {exc}".splitlines()[0]
    if not saved or not saved[0]:
        return None
    data, info = saved
    held = sum(len(v) for v in getattr(info, "artifacts", {}).values())
    tmp = out_dir / f".{FILE}.{os.getpid()}"
    try:
        tmp.write_bytes(data)
        (out_dir / f".{ABOUT}.{os.getpid()}").write_text(json.dumps(
            {"made_on": _made_on(device), "artifacts": held, "bytes": len(data), **counts}))
        os.replace(tmp, out_dir / FILE)
        os.replace(out_dir / f".{ABOUT}.{os.getpid()}", out_dir / ABOUT)
    except OSError as exc:   # a full disk: the run goes on, uncached
        tmp.unlink(missing_ok=True)
        return f"compile cache not saved in {out_dir}: {exc.strerror or exc}"
    return (f"compile cache: {counts['graphs_found']} graph(s) found in the cache, {counts['graphs_compiled']} "
            f"compiled; {held} artifact(s), {len(data) / 2**20:.1f} MiB kept in {out_dir / FILE}")


def copy_into(folder: Path, out_dir: Path) -> None:
    """Into a checkpoint being written: the output folder's cache, so that a resume elsewhere (a node that joins,
    the outputs store) compiles no more than this node did. Best effort: the checkpoint never fails for it."""
    if (out_dir / FILE).is_file() and (out_dir / ABOUT).is_file():
        try:
            shutil.copyfile(out_dir / ABOUT, folder / ABOUT)
            shutil.copyfile(out_dir / FILE, folder / FILE)
        except OSError:
            for name in (FILE, ABOUT):
                (folder / name).unlink(missing_ok=True)
