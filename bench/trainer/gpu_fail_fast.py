"""How long a run takes to end when one rank raises while the others wait in an NCCL collective (issue 39, 1).

    python3 bench/trainer/gpu_fail_fast.py --gpus 2 [--trainer-root DIR] [--limit 120]

Runs the built-in trainer (the demo model, on GPUs) under torchrun with a sitecustomize that makes rank 1 raise
in its third logging all_reduce, so rank 0 sits in that all_reduce. Prints the seconds from start to torchrun's
exit, its exit code, and whether rank 1's traceback reached the output. With the trainer of an earlier tree
(--trainer-root: a folder holding its `trainer/`), the same for that one: the old `finally: destroy_process_group()`
blocked under NCCL, so the exception was never printed and the run hung until --limit.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FAULT = '''\
import os
import torch.distributed as dist

_all_reduce = dist.all_reduce
calls = [0]


def failing(tensor, *args, **kwargs):
    if tensor.numel() == 4 and os.environ.get("RANK") == "1":
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("injected fault in the logging all_reduce of rank 1")
    return _all_reduce(tensor, *args, **kwargs)


dist.all_reduce = failing
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trial(root: Path, gpus: int, limit: float, work: Path) -> dict:
    hook = work / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(FAULT)
    env = {**os.environ, "PYTHONPATH": f"{hook}:{root}", "NODECTL_DEMO_CACHE": str(work / "demo"),
           "OMP_NUM_THREADS": "4"}
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={gpus}", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", "-m", "trainer", "--set", f"train.output_dir={work / 'out'}",
            "--set", "train.steps=200", "--set", "train.log_every=1"]
    started = time.monotonic()
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=limit, cwd=work)
        code, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as expired:
        code = "hung"
        output = (expired.stdout or b"").decode(errors="replace") + (expired.stderr or b"").decode(errors="replace")
        subprocess.run(["pkill", "-9", "-f", str(work / "out")], capture_output=True)
    return {"seconds": round(time.monotonic() - started, 1), "exit": code,
            "traceback shown": "RuntimeError: injected fault" in output, "tail": output[-600:]}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--limit", type=float, default=120)
    parser.add_argument("--trainer-root", type=Path, action="append", default=[],
                        help="another tree's root holding trainer/ (repeatable); this tree is always run")
    args = parser.parse_args()
    for root in [REPO, *args.trainer_root]:
        with tempfile.TemporaryDirectory() as work:
            found = trial(root, args.gpus, args.limit, Path(work))
        print(f"{root}: {found['seconds']} s, exit {found['exit']}, traceback shown: {found['traceback shown']}",
              flush=True)
        print("  " + found["tail"].replace("\n", "\n  ")[-600:], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
