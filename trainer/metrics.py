"""What the trainer reports: metrics.jsonl on rank 0, a heartbeat per rank, the console line, and faulthandler
on SIGUSR1 so `nodectl stacks` can ask a hung rank where it is."""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import time
from pathlib import Path

# Dense bf16 peak per GPU (vendor datasheets), for MFU. NODECTL_PEAK_TFLOPS overrides.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0}


def peak_flops(device_name: str | None) -> float | None:
    if os.environ.get("NODECTL_PEAK_TFLOPS"):
        return float(os.environ["NODECTL_PEAK_TFLOPS"]) * 1e12
    for key, tflops in PEAK_TFLOPS.items():
        if device_name and key in device_name:
            return tflops * 1e12
    return None


def flops_per_token(trainable: int, matmul_params: int, layers: int, hidden: int, seq_len: int) -> float:
    """Model FLOPs per token of one training step (the figure MFU is computed from; see README).
    `matmul_params`: every weight a token is multiplied by (all parameters but the input embedding, which is a
    lookup). Forward 2 FLOPs per such weight; backward 2 more for input gradients plus 2 per trainable weight
    for weight gradients (the frozen base gets none); attention scores and values 12·layers·hidden·seq for a
    token in a row of `seq_len` tokens (every pair counted: the non-causal convention).
    Recomputed forwards (activation checkpointing) are overhead, not model FLOPs, and are not counted."""
    return 4 * matmul_params + 2 * trainable + 12 * layers * hidden * seq_len


def window_flops(trainable: int, matmul_params: int, layers: int, hidden: int, tokens: float,
                 squared_lengths: float, causal: bool) -> float:
    """Model FLOPs of a window of rows from their real lengths: the dense part per token, attention per row
    (12·layers·hidden·len² for a row of len real tokens; half of it when only the causal pairs are counted).
    With rows of one length L this is tokens × flops_per_token(..., L) (non-causal)."""
    attention = 12 * layers * hidden * squared_lengths
    return (4 * matmul_params + 2 * trainable) * tokens + (attention / 2 if causal else attention)


class Sinks:
    """TensorBoard and W&B on rank 0, when the recipe asks: the records of metrics.jsonl as scalars (train/loss,
    eval/eval_loss, ...) at their step. Neither package is needed otherwise."""

    def __init__(self, recipe, out_dir: Path) -> None:
        self.writer = self.run = None
        if recipe.train.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(out_dir / "tensorboard"))
        if recipe.train.wandb_project:
            import dataclasses

            import wandb

            self.run = wandb.init(project=recipe.train.wandb_project, dir=str(out_dir),
                                  name=os.environ.get("NODECTL_RUN_ID") or None, config=dataclasses.asdict(recipe))

    def write(self, record: dict, group: str) -> None:
        values = {f"{group}/{key}": float(value) for key, value in record.items()
                  if key not in ("step", "time") and isinstance(value, (int, float)) and not isinstance(value, bool)}
        if self.writer:
            for key, value in values.items():
                self.writer.add_scalar(key, value, record["step"])
            self.writer.flush()
        if self.run:
            self.run.log(values, step=record["step"])

    def close(self) -> None:
        if self.writer:
            self.writer.close()
        if self.run:
            self.run.finish()


class Reporter:
    def __init__(self, out_dir: Path, rank: int, recipe=None, per: str = "gpu") -> None:
        run_dir = os.environ.get("NODECTL_RUN_DIR")
        self.rank, self.per = rank, per   # "rank" on CPU: a CPU run's figures are not per GPU
        self.sinks = Sinks(recipe, out_dir) if rank == 0 and recipe is not None else None
        self.heartbeat_dir = Path(run_dir) / "heartbeat" if run_dir else out_dir / "heartbeat"
        self.heartbeat_dir.mkdir(parents=True, exist_ok=True)
        (self.heartbeat_dir.parent / "timing").mkdir(parents=True, exist_ok=True)
        self.metrics = open(out_dir / "metrics.jsonl", "a", encoding="utf-8") if rank == 0 else None
        self.last: dict = {}
        self.phases: dict[str, float] = {}   # checkpoint_s, eval_s: cumulative seconds aside from training
        self._register_stacks()

    def _register_stacks(self) -> None:
        path = os.environ.get("NODECTL_STACK_FILE")
        if not path:
            return
        self._stack_file = open(path, "a", encoding="utf-8")
        faulthandler.register(signal.SIGUSR1, file=self._stack_file, all_threads=True)
        Path(path).with_suffix(".ready").write_text(str(os.getpid()))

    def phase(self, key: str, seconds: float) -> None:
        """Seconds training waited on something (`checkpoint_s`, `eval_s`), summed into every later heartbeat:
        the goodput ledger's (nodectl/goodput.py)."""
        self.phases[key] = round(self.phases.get(key, 0.0) + seconds, 4)

    def note(self, text: str | None) -> None:
        """A line every later heartbeat of this rank carries (`warning`, which `status` shows) until replaced."""
        if text:
            self.last = {**self.last, "warning": text}
        else:
            self.last = {k: v for k, v in self.last.items() if k != "warning"}

    def heartbeat(self, step: int, **extra) -> None:
        path = self.heartbeat_dir / f"rank{self.rank}.json"
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        now = time.time()
        if getattr(self, "first_at", None) is None:   # the goodput ledger's end of start-up, and where it began
            self.first_at, self.first_step = now, step
        tmp.write_text(json.dumps({"step": step, "time": now, "first_step_at": self.first_at,
                                   "first_step": self.first_step, **self.last,
                                   **self.phases, **extra}))
        os.replace(tmp, path)

    def timing(self, step: int, step_time: float) -> None:
        """This rank's own step time over the last logging window (host clock), to spot a straggler."""
        with open(self.heartbeat_dir.parent / "timing" / f"rank{self.rank}.jsonl", "a", encoding="utf-8") as out:
            out.write(json.dumps({"step": step, "step_time_s": step_time, "time": time.time()}) + "\n")

    def event(self, record: dict) -> None:
        if self.sinks:
            self.sinks.write(record, "eval" if "eval_loss" in record else "event")
        if self.metrics:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
            print(" ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()),
                  flush=True)

    def log(self, record: dict) -> None:
        self.last = {"loss": record.get("loss"), "tokens_per_s": record.get("tokens_per_s_per_gpu"),
                     **({"warning": self.last["warning"]} if "warning" in self.last else {})}
        if self.sinks:
            self.sinks.write(record, "train")
        if self.metrics:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
            mfu = f" mfu {record['mfu']:.1%}" if record.get("mfu") is not None else ""
            memory = f" mem {record['max_memory_gb']:.1f}GB" if record.get("max_memory_gb") else ""
            print(f"step {record['step']:>5} loss {record['loss']:.4f} lr {record['lr']:.2e} "
                  f"gnorm {record['grad_norm']:.3f} tok/s/{self.per} {record['tokens_per_s_per_gpu']:.0f}{mfu}{memory}",
                  flush=True)

    def close(self) -> None:
        if self.sinks:
            self.sinks.close()
        if self.metrics:
            self.metrics.close()
