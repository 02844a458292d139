"""The built-in trainer under torchrun on CPU ranks (gloo), for tests of every level."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from nodectl.resources.launchers.ports import quiet_port
from support import REPO


def free_port() -> int:
    """A port torchrun's store can take: outside the ephemeral range, from which the ranks' own connections (and
    every other test's) draw theirs (a port from bind(0) was taken before torchrun listened, in CI)."""
    return quiet_port()


def torchrun(nproc: int, out: Path, demo_cache: Path, *sets: str, timeout: float = 240,
             pythonpath: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ":".join([*pythonpath, str(REPO)]), "NODECTL_DEMO_CACHE": str(demo_cache),
           "OMP_NUM_THREADS": "1"}
    env.pop("NODECTL_RUN_DIR", None)
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", "-m", "trainer", "--set", f"train.output_dir={out}"]
    for assignment in sets:
        argv += ["--set", assignment]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=out.parent)


def torchrun_nodes(nodes: int, per_node: int, out: Path, demo_cache: Path, *sets: str,
                   timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """`nodes` torchrun agents of `per_node` ranks each, as `nodectl launch --nodes N --gpus G` starts them (one
    rendezvous, node-major global ranks); each agent writes to its own out/node<i> (nodes have their own disks).
    Rank 0's records are in out/node0."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "NODECTL_DEMO_CACHE": str(demo_cache), "OMP_NUM_THREADS": "1"}
    env.pop("NODECTL_RUN_DIR", None)
    port = free_port()
    agents = []
    for node in range(nodes):
        argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node-rank={node}",
                f"--nproc-per-node={per_node}", "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "trainer",
                "--set", f"train.output_dir={out / f'node{node}'}"]
        for assignment in sets:
            argv += ["--set", assignment]
        agents.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       cwd=out.parent))
    done = []
    for agent in agents:
        try:
            stdout, stderr = agent.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in agents:
                other.kill()
            raise
        done.append(subprocess.CompletedProcess(agent.args, agent.returncode, stdout, stderr))
    return done


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def demo_folder(demo_cache: Path) -> Path:
    """Where the trainer builds its demo model and data under NODECTL_DEMO_CACHE (versioned by the trainer)."""
    from support.trainer_import import trainer_module

    return demo_cache / f"demo-v{trainer_module('demo').DEMO_VERSION}"
