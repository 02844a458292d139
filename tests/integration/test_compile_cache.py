"""model.compile's work kept with the run (trainer/compile_cache.py), for real: a process compiles a layer (with an
autograd.Function of its own, as the trainer's layers have) with Inductor on the CPU, saves torch's portable cache artifacts into its output folder, and a checkpoint written then
carries a copy; a second process whose own compiler caches are empty (another node: its own TORCHINDUCTOR_CACHE_DIR)
loads them from that checkpoint and compiles nothing. A damaged file or one made with another torch is said and
left unused."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from support import REPO

pytestmark = pytest.mark.slow

NODE = '''\
import json, sys
from pathlib import Path
import torch
from trainer import compile_cache

out, sources = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
out.mkdir(parents=True, exist_ok=True)
print("LOAD", json.dumps(compile_cache.load(sources, torch.device("cpu"))), flush=True)
if out.name == "load-only":
    sys.exit(0)


class Twice(torch.autograd.Function):   # an autograd.Function of its own, as the trainer's FP8 experts have
    @staticmethod
    def forward(ctx, t):
        return t * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


torch.manual_seed(0)
x = torch.randn(4, 32, requires_grad=True)
loss = torch.compile(lambda t: Twice.apply(t.sin()).square().sum())(x)   # a forward and a backward graph
loss.backward()
print("LOSS", float(loss), float(x.grad.abs().sum()))
print("SAVE", json.dumps(compile_cache.save(out, torch.device("cpu"))))
from torch._dynamo.utils import counters
print("COUNTERS", json.dumps({kind: dict(counters[kind]) for kind in ("inductor", "aot_autograd")}))
'''


def node(tmp_path, name: str, out, *sources) -> dict:
    """One "node": its own compiler caches, its own output folder; what it said, by line kind."""
    home = tmp_path / name
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCHINDUCTOR_CACHE_DIR": str(home / "inductor"),
           "TRITON_CACHE_DIR": str(home / "triton"), "HOME": str(home), "OMP_NUM_THREADS": "1",
           "TORCHINDUCTOR_COMPILE_THREADS": "1"}   # no pool of compile workers (each would import torch)
    done = subprocess.run([sys.executable, "-c", NODE, str(out), *map(str, sources)], env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    said = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in done.stdout.splitlines() if " " in line}
    return {"load": json.loads(said["LOAD"]), "loss": said.get("LOSS"),
            "save": json.loads(said["SAVE"]) if "SAVE" in said else None,
            "counters": json.loads(said["COUNTERS"]) if "COUNTERS" in said else None}


def test_a_node_with_empty_caches_loads_the_checkpoints_copy_and_compiles_nothing(tmp_path):
    from trainer import compile_cache

    if not compile_cache.available():
        pytest.skip("torch < 2.7 has no portable cache artifacts")
    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("Inductor on a CPU needs a C++ compiler")
    first_out = tmp_path / "node0-output"
    first = node(tmp_path, "node0", first_out)
    assert first["load"] is None   # nothing to load on a first attempt
    assert "0 graph(s) found in the cache" in first["save"] and "compiled" in first["save"], first["save"]
    compiled = int(first["save"].split("found in the cache, ")[1].split(" ")[0])
    assert compiled >= 2, first["save"]   # the forward and the backward, at least
    about = json.loads((first_out / compile_cache.ABOUT).read_text())
    assert about["made_on"]["torch"] and about["bytes"] == (first_out / compile_cache.FILE).stat().st_size > 0

    # a checkpoint written now carries the cache, as it travels to another node
    checkpoint = tmp_path / "sent" / "ckpt-000010"
    checkpoint.mkdir(parents=True)
    compile_cache.copy_into(checkpoint, first_out)
    second = node(tmp_path, "node1", tmp_path / "node1-output", checkpoint, tmp_path / "node1-output")
    assert second["load"].startswith(f"compile cache: {about['artifacts']} artifact(s) loaded from {checkpoint}")
    # nothing compiled again, the graphs that hold an autograd.Function included (torch's caches leave those out
    # unless told: each start compiled them again, and an earlier count of "compiled" did not show them)
    assert second["save"].startswith(f"compile cache: {compiled} graph(s) found in the cache, 0 compiled;"), second
    assert "not cacheable" not in first["save"] + second["save"]
    aot, inductor = second["counters"]["aot_autograd"], second["counters"]["inductor"]
    assert aot.get("autograd_cache_hit", 0) >= 1 and not aot.get("autograd_cache_bypass"), second["counters"]
    assert not inductor.get("fxgraph_cache_miss") and not inductor.get("fxgraph_cache_bypass"), second["counters"]
    assert second["loss"] == first["loss"]   # the same numbers from the loaded kernels

    # a damaged file, and one made with another torch: said, and not used (the run then compiles as the first did)
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    compile_cache.copy_into(damaged, first_out)
    (damaged / compile_cache.FILE).write_bytes(b"\x00not a cache")
    third = node(tmp_path, "node2", tmp_path / "load-only", damaged)
    assert third["load"].startswith(f"compile cache in {damaged} not used: "), third["load"]
    other = json.loads((damaged / compile_cache.ABOUT).read_text())
    other["made_on"]["torch"] = "2.6.0+cu124"
    (damaged / compile_cache.ABOUT).write_text(json.dumps(other))
    (damaged / compile_cache.FILE).write_bytes((first_out / compile_cache.FILE).read_bytes())
    fourth = node(tmp_path, "node3", tmp_path / "load-only", damaged)
    assert "not used: made with" in fourth["load"] and "2.6.0+cu124" in fourth["load"], fourth["load"]
