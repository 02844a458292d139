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


def allow_caching() -> None:
    """Let torch's caches keep every graph of the trainer's compiled layers; without this, each start of a rank
    traced and compiled most of them again, whatever the caches held. Two kinds of operator made torch leave a graph
    out of its caches (AOTAutograd's and Inductor's):
    - the trainer's own autograd.Functions (the FP8 experts' grouped GEMM, the experts' adapter path: trainer/fp8.py,
      trainer/moe.py), which Dynamo traces into a layer as one operator, autograd_function_apply, with their forward
      and backward as subgraphs of the graph, so the caches' key covers their code. torch keeps such graphs only
      when told (torch._functorch.config.autograd_cache_allow_custom_autograd_functions).
    - activation checkpointing's replay of an operator that draws random numbers (attention's kernels count as
      such), graphsafe_run_with_rng_state: its RNG state is an input of the compiled code, so a kept graph replays
      whatever state it is given. torch marks it cacheable itself from pytorch #185562 (2026-06) on; on torch 2.11
      and later releases without that mark, it is marked here (torch._inductor.config.unsafe_marked_cacheable_functions,
      keyed by the torch version, which is part of every cache key). Before 2.11 it is left alone: not tried there.
    Measured on an H100 (Qwen3-30B-A3B cut to 24 layers, torch 2.11, docs/PERFORMANCE.md): the restarted rank's
    compiling went from 12.9 s to 3.9 s, every graph found in the cache, and a crash to the new attempt's first step
    from 27.7 s to 20.6 s; with dropout in the checkpointed layers, the steps done again gave the losses of the
    first attempt as closely as recompiled graphs do."""
    from torch._functorch import config as functorch
    from torch._inductor import config as inductor
    from torch.torch_version import TorchVersion

    if hasattr(functorch, "autograd_cache_allow_custom_autograd_functions"):
        functorch.autograd_cache_allow_custom_autograd_functions = True
    try:
        from torch._prims.rng_prims import graphsafe_run_with_rng_state as replay
    except ImportError:   # a torch without it has nothing to mark
        return
    marked = getattr(inductor, "unsafe_marked_cacheable_functions", None)
    if TorchVersion(torch.__version__.split("+")[0]) >= "2.11" and isinstance(marked, dict) \
            and not replay.cacheable():
        inductor.unsafe_marked_cacheable_functions = {**marked,
                                                      f"{replay.__module__}.{replay.__name__}": torch.__version__}


def _counts() -> dict:
    from torch._dynamo.utils import counters

    inductor, aot = counters["inductor"], counters["aot_autograd"]
    # a graph torch keeps no cache for (an operator its caches refuse) is traced or compiled again at every start
    return {"graphs_found": inductor["fxgraph_cache_hit"] + aot["autograd_cache_hit"],
            "graphs_compiled": inductor["fxgraph_cache_miss"] + aot["autograd_cache_miss"]
            + inductor["fxgraph_cache_bypass"],
            "graphs_not_cacheable": inductor["fxgraph_cache_bypass"] + aot["autograd_cache_bypass"]}


def load(sources: list[Path], device: torch.device) -> str | None:
    """Load the first cache file of `sources` (folders: the checkpoint resumed from, then the output folder) made
    with this torch on this kind of device. Returns what to say, or None where there is none. Called before the
    first step compiles: from then on torch's caches keep every graph of the trainer's layers (allow_caching)."""
    if not available():
        return None
    allow_caching()
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
    uncached = (f", {counts['graphs_not_cacheable']} not cacheable by torch {torch.__version__} (done again at every "
                f"start)" if counts["graphs_not_cacheable"] else "")
    return (f"compile cache: {counts['graphs_found']} graph(s) found in the cache, {counts['graphs_compiled']} "
            f"compiled{uncached}; {held} artifact(s), {len(data) / 2**20:.1f} MiB kept in {out_dir / FILE}")


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
