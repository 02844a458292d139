"""The training loop. Every collective is called by every rank, in the same order; what is logged is reduced
across ranks only at the logging interval, so steps in between never wait on the host."""
from __future__ import annotations

import functools
import json
import math
import os
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from . import checkpoint, compile_cache, demo, evaluate, resume
from . import layout as layouts
from .config import ConfigError, Recipe
from .data import IGNORE, StepBatches, load_examples
from .metrics import Reporter, peak_flops, window_flops
from .telemetry import Telemetry
from .model import (Parallel, build_skeleton, graph_breaks, inactive_expert_params, materialise, materialise_random,
                    materialise_sliced, parallelize, parameter_counts)
from .weights import checkpoint_files


@dataclass
class Context:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    on_gpu: bool


def distributed_context() -> Context:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    on_gpu = torch.cuda.is_available() and os.environ.get("NODECTL_DEVICE", "") != "cpu"
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    if "OMP_NUM_THREADS" not in os.environ:
        # torchrun sets 1 only where a node runs several ranks; a node's only rank would start a thread per core
        # for each host-side tensor operation (checkpoints copy a few thousand of them).
        torch.set_num_threads(max(1, min(8, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))))
    return Context(rank, world, local_rank, device, on_gpu)


def _share_cpus(ctx: Context) -> None:
    """Threads for a rank started without OMP_NUM_THREADS (no launcher read its node): its CPUs over every rank of
    the world on the same kernel whose CPUs meet its own. Nodes of one machine (containers, namespaces, local
    "nodes") each counted only their own ranks and spun OpenMP threads against each other, 4x slower on 2 cores."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="utf-8") as handle:
            boot = handle.read().strip()
    except OSError:
        return
    cpus = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()
    if not cpus:
        return
    everyone: list = [None] * ctx.world
    dist.all_gather_object(everyone, (boot, cpus))
    sharing = sum(1 for other_boot, other_cpus in everyone if other_boot == boot and other_cpus & cpus)
    torch.set_num_threads(max(1, min(8, len(cpus) // max(1, sharing))))


def resolve_paths(recipe: Recipe) -> tuple[Path, Path]:
    model_path = Path(os.path.expanduser(recipe.model.path)) if recipe.model.path != "demo" else None
    data_path = Path(os.path.expanduser(recipe.data.path)) if recipe.data.path != "demo" else None
    if model_path is None or data_path is None:
        demo_model, demo_data = demo.ensure_demo()
        model_path, data_path = model_path or demo_model, data_path or demo_data
    return model_path, data_path


def check_packing_support() -> None:
    """Packed rows rely on transformers reading documents from position ids (attention_mask None, no cache):
    masking_utils.find_packed_sequence_indices. An older transformers would let documents attend to each other."""
    from transformers import masking_utils

    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        import transformers

        raise ConfigError(f"data.packing: transformers {transformers.__version__} cannot keep packed documents "
                          f"apart (no packed-sequence masks); upgrade transformers or set data.packing: false")


def lr_at(step: int, recipe: Recipe) -> float:
    warmup, total, peak = recipe.train.warmup_steps, recipe.train.steps, recipe.train.lr
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(recipe: Recipe) -> dict:
    ctx = distributed_context()
    dtype = torch.bfloat16 if (recipe.model.dtype == "bfloat16" or (recipe.model.dtype == "auto" and ctx.on_gpu)) \
        else torch.float32
    model_path, data_path = resolve_paths(recipe)
    model = build_skeleton(recipe, model_path, dtype)  # raises ConfigError on every rank alike
    if recipe.model.init == "checkpoint" and recipe.model.load == "sliced":
        checkpoint_files(model_path)  # every node needs its own copy: say so before any process group exists
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    say = print if ctx.rank == 0 else None
    if recipe.data.packing:
        check_packing_support()
    examples = load_examples(data_path, tokenizer, recipe.data.max_length, recipe.data.packing,
                             recipe.data.overlong, log=say)
    shape = layouts.shape_of(model, recipe)
    chosen, recipe = _layout(recipe, shape, ctx)
    if recipe.model.fp8_experts:
        _check_fp8(chosen, ctx)
    if recipe.model.expert_lora_kernel == "triton":
        from .moe import triton_kernels_here

        why = "the ranks run on CPUs" if not ctx.on_gpu else triton_kernels_here()
        if why:
            raise ConfigError(f"model.expert_lora_kernel: triton needs a CUDA GPU and Triton ({why}); set auto")
    dist.init_process_group("nccl" if ctx.on_gpu else "gloo", device_id=ctx.device if ctx.on_gpu else None,
                            timeout=timedelta(seconds=recipe.train.collective_timeout_s))
    if "OMP_NUM_THREADS" not in os.environ:
        _share_cpus(ctx)
    mesh = layouts.mesh(chosen, ctx.device.type)
    torch.manual_seed(recipe.train.seed)
    parallel = parallelize(model, recipe, mesh, dtype == torch.bfloat16, chosen, layouts.expert_group(chosen, mesh),
                           shape)
    loading = time.perf_counter()
    if recipe.model.init == "random":
        materialise_random(model, ctx.device, recipe.train.seed, parallel.experts)
    elif recipe.model.load == "sliced":
        materialise_sliced(model, model_path, ctx.device, recipe.train.seed, parallel.experts)
    else:
        materialise(model, model_path, ctx.device, ctx.rank, recipe.train.seed)
    if recipe.model.fp8_experts:
        from . import moe

        converted = moe.quantize_experts(model)
        if not converted:   # the same model on every rank: every rank stops here alike
            raise ConfigError("model.fp8_experts: this model has no fused routed experts on the grouped path "
                              f"({', '.join(parallel.peft_path) or 'a dense model'}); turn fp8_experts off")
        if ctx.rank == 0:
            print(f"fp8_experts: {converted} routed-expert weights held as e4m3 (per-channel scales)", flush=True)
    if ctx.rank == 0:
        print(f"weights loaded ({recipe.model.init if recipe.model.init == 'random' else recipe.model.load}) in "
              f"{time.perf_counter() - loading:.1f}s", flush=True)
    out_dir = recipe.output_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    return _loop(recipe, ctx, model, parallel, examples, tokenizer, out_dir)


def _check_fp8(chosen, ctx: Context) -> None:
    """model.fp8_experts where it can run: FSDP must not shard the experts (it would gather them in bf16), and the
    GPU and torch must have FP8 grouped GEMMs. The same answer on every rank."""
    from . import fp8

    if chosen.frozen_sharded and not chosen.name.startswith("expert"):
        raise ConfigError(f"model.fp8_experts: the {chosen.name} layout shards the experts' frozen weights through "
                          f"FSDP; set model.parallelism: replicate or expert, or turn fp8_experts off")
    why = fp8.supported(ctx.device)
    if why:
        raise ConfigError(f"model.fp8_experts: {why}")


def _layout(recipe: Recipe, shape, ctx: Context):
    """The layout (model.parallelism), and the recipe with train.micro_batch_size and model.activation_checkpointing
    as chosen where they say auto; what was chosen and why printed by rank 0."""
    micro, share = recipe.train.micro_batch_size, recipe.model.activation_checkpointing
    rows = recipe.train.batch_size if micro == "auto" else micro * recipe.train.grad_accum
    chosen, split = layouts.plan(recipe.model.layout, shape, layouts.device_memory(ctx.device), *layouts.topology(),
                                 rows=rows, max_length=recipe.data.max_length, micro=None if micro == "auto" else micro,
                                 share=None if share == "auto" else float(share),
                                 leaves_out=layouts.fsdp_leaves_params_out(), unit="GPU" if ctx.on_gpu else "rank")
    if ctx.rank == 0:
        print(chosen.describe(), flush=True)
    if "auto" not in (micro, share):
        return chosen, recipe
    if ctx.rank == 0:
        print(split.reason, flush=True)
    return chosen, replace(recipe, train=replace(recipe.train, micro_batch_size=split.micro,
                                                 grad_accum=rows // split.micro, batch_size=rows),
                           model=replace(recipe.model, activation_checkpointing=split.share))


class EarlyStop:
    """Plateau detection on eval loss. Every rank sees the same all-reduced loss, so all stop at the same step."""

    def __init__(self, patience: int, min_delta: float) -> None:
        self.patience, self.min_delta = patience, min_delta
        self.best, self.best_step, self.bad = math.inf, 0, 0

    def update(self, step: int, loss: float) -> str | None:
        if loss < self.best - self.min_delta:
            self.best, self.best_step, self.bad = loss, step, 0
            return None
        self.bad += 1
        if self.patience and self.bad >= self.patience:
            return (f"plateau: eval loss did not improve by {self.min_delta} for {self.bad} evaluation(s) "
                    f"(best {self.best:.4f} at step {self.best_step})")
        return None


def _eval_set(recipe: Recipe, examples, tokenizer):
    train_examples, held = evaluate.split(examples, recipe.data.eval_holdout, recipe.data.seed)
    if recipe.data.eval_path:
        held = load_examples(os.path.expanduser(recipe.data.eval_path), tokenizer, recipe.data.max_length, False,
                             recipe.data.overlong)
    return train_examples, evaluate.eval_subset(held, recipe.data.eval_samples, recipe.data.seed) if held else []


def _loop(recipe: Recipe, ctx: Context, model, parallel: Parallel, examples, tokenizer, out_dir: Path) -> dict:
    examples, eval_set = _eval_set(recipe, examples, tokenizer)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=recipe.train.lr, weight_decay=recipe.train.weight_decay,
                                  betas=(0.9, 0.95), fused=ctx.on_gpu or None)
    batches = StepBatches(examples, micro_batch_size=recipe.train.micro_batch_size,
                          grad_accum=recipe.train.grad_accum, world_size=ctx.world, rank=ctx.rank,
                          seed=recipe.data.seed, pad_id=tokenizer.pad_token_id or 0)
    start_step, resumed = _resume(recipe, ctx, model, parallel, optimizer, out_dir)
    cached = _CompileCache(recipe, ctx, out_dir, resumed)   # before the first step compiles
    reporter = Reporter(out_dir, ctx.rank, recipe, per="gpu" if ctx.on_gpu else "rank")
    telemetry = Telemetry(Path(os.environ["NODECTL_RUN_DIR"]) / "metrics" if os.environ.get("NODECTL_RUN_DIR")
                          else Path(out_dir)).start()   # metrics/: a folder the ranks may write in a container
    config = model.base_model.model.config
    trainable, frozen = parameter_counts(model, parallel.experts)
    idle_frozen, idle_trainable = inactive_expert_params(model, parallel.experts)
    matmul_params = trainable + frozen - model.get_input_embeddings().weight.numel() - idle_frozen - idle_trainable
    flops = functools.partial(window_flops, trainable - idle_trainable, matmul_params, config.num_hidden_layers,
                              config.hidden_size)
    summary: dict = {"trainable_params": trainable, "frozen_params": frozen, "resumed_from": start_step or None,
                     "threads": torch.get_num_threads(),
                     "end_reason": f"completed {recipe.train.steps} steps"}
    covered, skipped = parallel.grouped, parallel.peft_path
    if ctx.rank == 0 and (covered or skipped):
        print(f"routed experts: grouped LoRA path in {covered} layer(s)"
              + (f", adapter products in {parallel.lora_kernel}" if covered else "")
              + (f"; peft's path in {len(skipped)} ({skipped[0]}, ...)" if skipped else ""), flush=True)
    if ctx.rank == 0:
        print(f"training {trainable:,} LoRA parameters over a frozen base of {frozen:,} on {ctx.world} rank(s)"
              + (f", resuming at step {start_step}" if start_step else ""), flush=True)
    # the parts that keep their own schedule: the loop trains a step, then asks each whether this step is its own
    evaluator = Evaluator(recipe, ctx, model, eval_set, tokenizer, reporter, summary)
    evaluator.at_start(start_step)
    checkpointer = Checkpointer(recipe, ctx, model, parallel, optimizer, out_dir, start_step, reporter)
    profiler = Profiler(recipe.train.profile_at, ctx, out_dir)
    adapters = AdapterSaves(recipe, model, out_dir)
    peak = peak_flops(torch.cuda.get_device_name(ctx.device) if ctx.on_gpu else None)
    logger = Logger(recipe, ctx, optimizer, flops, peak, reporter, summary)   # its first window starts now
    step = start_step
    for step in range(start_step, recipe.train.steps):
        done, last = step + 1, step + 1 == recipe.train.steps
        profiler.before(done)
        if recipe.train.traffic_at == done:   # the traffic counter's one step: collectives counted and logged
            _counted_step(recipe, ctx, model, parallel, optimizer, params, batches, step, logger.window, reporter)
        else:
            _train_step(recipe, ctx, model, optimizer, params, batches, step, logger.window)
        profiler.after(done, last)
        logged = logger.after(done, last)
        if done == start_step + 1:
            with logger.aside():
                cached.after_first_step()
        # after the record: a logging step's heartbeat carries its own loss; data_s: the pace's data-wait share
        reporter.heartbeat(done, data_s=round(batches.waited, 4))
        checkpointer.poll()
        evaluates, saves = evaluator.due(done), checkpointer.every(done) or adapters.due(done)
        if (evaluates or saves) and logger.steps and ctx.on_gpu:
            torch.cuda.synchronize(ctx.device)  # queued training work belongs to the window, not to the aside
        due, stopping = checkpointer.asked(logged)
        with logger.aside():   # evaluation and saving are not training time
            reason = evaluator.run(done) if evaluates else None
            checkpointer.after(done, due, stopping)
            if stopping and not last:
                telemetry.stop()
                reporter.event({"step": done, "stop": "SIGTERM"})
                reporter.close()
                if ctx.rank == 0:
                    print(f"stopped by SIGTERM at step {done}; checkpoint written: launch --resume continues from "
                          f"it", flush=True)
                raise SystemExit(128 + signal.SIGTERM)
            adapters.after(done, last)
        if reason:
            summary["end_reason"] = reason
            reporter.event({"step": done, "stop": reason})
            step += 1
            break
    else:
        step = recipe.train.steps
    checkpointer.at_end(step)
    reporter.heartbeat(step, data_s=round(batches.waited, 4))   # the phases' last totals, for the goodput ledger
    telemetry.stop()
    if recipe.train.save_probe_logits:
        _save_probe(model, batches.micro_batches(0)[0], ctx, out_dir)
    saved = checkpoint.save_adapter(model, out_dir, step, recipe.train.keep_last)
    summary.update(adapter=saved, steps=step, best_eval_loss=evaluator.best)
    if ctx.rank == 0:
        print(f"adapter saved to {out_dir / 'adapter'} ({saved['gathered_bytes'] / 2**20:.2f} MiB gathered in "
              f"{saved['seconds']:.2f}s); {summary['end_reason']}", flush=True)
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    reporter.close()
    return summary


class Logger:
    """The log window (train.log_every): the loss, tokens and grad norm it accumulates on the device (`window`,
    which the steps add to), reduced across ranks once per window, with the window's time from the clock after
    the GPU finished; what the loop does aside (evaluation, saving) is kept out of that time."""

    def __init__(self, recipe: Recipe, ctx: Context, optimizer, flops, peak: float | None, reporter, summary: dict):
        self.every, self.ctx, self.optimizer, self.flops, self.peak = recipe.train.log_every, ctx, optimizer, flops, peak
        self.reporter, self.summary = reporter, summary
        self.window = torch.zeros(4, device=ctx.device)  # loss sum, target tokens, real tokens, sum of squared lengths
        self.start, self.steps = time.perf_counter(), 0

    def after(self, done: int, last: bool) -> bool:
        """A step trained: at the window's end, its record logged. True at a logging step."""
        self.steps += 1
        if done % self.every and not last:
            return False
        record = _reduce_window(self.ctx, done - 1, self.window, self.start, self.steps, self.optimizer, self.flops,
                                self.peak)
        self.start = record.pop("_clock")  # the next window starts where this one was measured to end
        self.reporter.log(record)
        self.reporter.timing(done, record["step_time_s"])
        self.summary.update(last_loss=record["loss"], first_loss=self.summary.get("first_loss", record["loss"]),
                            tokens_per_s_per_gpu=record["tokens_per_s_per_gpu"], mfu=record["mfu"])
        self.window.zero_()
        self.steps = 0
        return True

    @contextmanager
    def aside(self):
        """Time spent here is not training time: the window's clock moves past it."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.start += time.perf_counter() - started


class Evaluator:
    """Held-out loss every train.eval_every steps (and at step 0 with train.eval_at_start), and the early stop
    it decides (train.early_stop_patience)."""

    def __init__(self, recipe: Recipe, ctx: Context, model, eval_set, tokenizer, reporter, summary: dict):
        self.recipe, self.ctx, self.model, self.eval_set, self.tokenizer = recipe, ctx, model, eval_set, tokenizer
        self.reporter, self.summary = reporter, summary
        self.stopper = EarlyStop(recipe.train.early_stop_patience, recipe.train.early_stop_min_delta)

    def due(self, done: int) -> bool:
        return bool(self.recipe.train.eval_every) and done % self.recipe.train.eval_every == 0

    def at_start(self, start_step: int) -> None:
        if self.recipe.train.eval_at_start and start_step == 0:
            self._evaluate(0)

    def run(self, done: int) -> str | None:
        """Evaluate; why training stops here (a plateau), or None."""
        began = time.perf_counter()
        loss = self._evaluate(done)
        self.reporter.phase("eval_s", time.perf_counter() - began)
        return self.stopper.update(done, loss)

    @property
    def best(self) -> float | None:
        return None if self.stopper.best == math.inf else self.stopper.best

    def _evaluate(self, step: int) -> float:
        loss = evaluate.evaluate(self.model, self.eval_set, rank=self.ctx.rank, world=self.ctx.world,
                                 batch_size=self.recipe.train.micro_batch_size,
                                 pad_id=self.tokenizer.pad_token_id or 0, device=self.ctx.device)
        self.reporter.event({"step": step, "eval_loss": loss, "eval_samples": len(self.eval_set), "time": time.time()})
        self.summary.setdefault("eval", []).append({"step": step, "loss": loss})
        return loss


class Checkpointer:
    """Resumable checkpoints (trainer/resume.py) by their three rules: every train.checkpoint_every steps, when
    train.checkpoint_minutes have passed, and when a rank was asked to stop (SIGTERM), the last two agreed by every
    rank at logging steps (Deadline); and one at the end, where either rule is set."""

    def __init__(self, recipe: Recipe, ctx: Context, model, parallel: Parallel, optimizer, out_dir: Path,
                 start_step: int, reporter):
        self.recipe, self.ctx, self.model, self.parallel, self.optimizer = recipe, ctx, model, parallel, optimizer
        self.out_dir, self.saved_at, self.reporter = out_dir, start_step, reporter
        self.timed, self.term = Deadline(recipe.train.checkpoint_minutes, ctx), TermRequest()
        self.background: resume.Background | None = None   # train.async_checkpoint's writer, from the first save
        self.decided = False
        self.told: dict[int, object] = {}   # step -> the reporter its record goes to (checkpoint_every's), or None

    def every(self, done: int) -> bool:
        return bool(self.recipe.train.checkpoint_every) and done % self.recipe.train.checkpoint_every == 0

    def asked(self, logging_step: bool) -> tuple[bool, bool]:
        """(a timed checkpoint is due, a rank was asked to stop): one small collective, at logging steps only; it
        also carries whether a background write failed on some rank, which every rank then raises at once."""
        if not logging_step:
            return False, False
        due, stop, failed = self.timed.check(self.term.asked, bool(self.background and self.background.failed))
        if failed:
            self.finish()
            raise resume.CheckpointError("a checkpoint written in the background failed on another rank; the "
                                         "previous complete checkpoint is intact: free space, then resume")
        return due, stop

    def after(self, done: int, due: bool, stopping: bool) -> None:
        every = self.every(done)
        if every or due or (stopping and done > self.saved_at):
            self._save(done, self.reporter if every else None)   # checkpoint_every's: an event in metrics.jsonl
        if stopping:
            self.finish()   # the stop's checkpoint is complete before the rank exits

    def at_end(self, step: int) -> None:
        """The end too: a finished run can be trained further (launch --resume RUN --set train.steps=MORE), and a
        restart after a failure past the last timed checkpoint loses nothing. A write still going is waited for."""
        if step > self.saved_at and (self.recipe.train.checkpoint_minutes or self.recipe.train.checkpoint_every):
            self._save(step, None)
        self.finish()

    def poll(self) -> None:
        """After each step: a background write that ended is told (no collective). One that failed is left for the
        next logging step, where every rank learns it together."""
        if not self.decided:
            self._in_background()
        if self.background is not None and not self.background.failed:
            self._told(self.background.finished())

    def finish(self) -> None:
        if self.background is not None:
            began = time.perf_counter()
            self.background.wait()
            self.reporter.phase("checkpoint_s", time.perf_counter() - began)
            self._told(self.background.finished())

    def _save(self, step: int, reporter) -> None:
        began = time.perf_counter()
        if self._in_background():
            self.background.wait()                    # at most one in flight: its pinned buffers are reused
            self._told(self.background.finished())
            staged = resume.stage(self.model, self.optimizer, step, self.out_dir / "checkpoints", self.ctx.device,
                                  self.recipe.train.keep_checkpoints, extra={"schedule_steps": self.recipe.train.steps},
                                  layout=self.parallel.layout, make_room=self.recipe.train.make_room,
                                  host=self.background.host)
            staged.staged_s = time.perf_counter() - began   # what training waited: the write before, the staging
            self.told[step] = reporter
            self.background.start(staged)
        else:
            _checkpoint(self.recipe, self.ctx, self.model, self.parallel, self.optimizer, step, self.out_dir,
                        reporter)
            self._foresee()
        self.reporter.phase("checkpoint_s", time.perf_counter() - began)   # training waited this long
        self.saved_at, self.timed = step, Deadline(self.recipe.train.checkpoint_minutes, self.ctx)

    def _in_background(self) -> bool:
        """train.async_checkpoint, decided after the first step (the optimizer's state exists then) by every rank
        alike: on (or auto on GPUs) where each node's host memory holds its ranks' staged state twice over, the
        pinned buffers then allocated in a thread while training goes on; else said once, and written while
        training waits."""
        if not self.decided:
            self.decided = True
            wanted = self.recipe.train.async_checkpoint
            if wanted is True or (wanted == "auto" and self.ctx.on_gpu):
                fits, said = resume.fits_in_host_memory(*resume.staging_bytes(self.model, self.optimizer),
                                                        self.ctx.device)
                if fits:
                    self.background = self._gloo_writer()
                    if self.background is not None:
                        self.background.host.reserve(self.model, self.optimizer)
                elif self.ctx.rank == 0:
                    print(f"train.async_checkpoint: the staged checkpoint ({said}) does not fit host memory twice "
                          f"over; checkpoints are written while training waits", flush=True)
        return self.background is not None

    def _gloo_writer(self) -> resume.Background | None:
        """The background writer and its gloo group, where every rank could make one (gloo connects the ranks
        over their nodes' network: GLOO_SOCKET_IFNAME where a node has several); else none on any rank, said."""
        try:
            writer, failed = resume.Background(), None
        except RuntimeError as exc:
            writer, failed = None, str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        everyone = torch.tensor([0.0 if failed else 1.0], device=self.ctx.device)
        dist.all_reduce(everyone, op=dist.ReduceOp.MIN)
        if everyone.item() >= 1:
            return writer
        if failed:
            print(f"rank {self.ctx.rank}: train.async_checkpoint: no gloo group for background writes ({failed}); "
                  f"checkpoints are written while training waits", flush=True)
        return None

    def _told(self, ended) -> None:
        """A background write that ended: its record or line, and the disk foresight; its failure is raised."""
        if ended is None:
            return
        staged, path, error, seconds = ended
        reporter = self.told.pop(staged.step, None)
        if error:
            raise resume.CheckpointError(error)
        size = sum(f.stat().st_size for f in path.glob("rank*.pt"))
        if reporter is not None:
            reporter.event({"step": staged.step, "checkpoint_s": round(staged.staged_s, 3),
                            "checkpoint_write_s": round(seconds, 3), "checkpoint_bytes_node": size})
        elif self.ctx.rank == 0:
            print(f"checkpoint at step {staged.step} written in {seconds:.2f}s beside training (training waited "
                  f"{staged.staged_s:.2f}s): {path}", flush=True)
        self._foresee()

    def _foresee(self) -> None:
        if int(os.environ.get("LOCAL_RANK", self.ctx.rank)) == 0:   # each node of its own disk: will the next fit?
            ahead = resume.foresee(self.out_dir / "checkpoints", self.recipe.train.make_room)
            if ahead:
                print(f"warning: {ahead}", flush=True)
            self.reporter.note(f"warning: {ahead}" if ahead else None)   # status shows it from the heartbeat


class _CompileCache:
    """model.compile's work kept for later attempts, resumes and nodes that join (trainer/compile_cache.py): loaded
    before the first step from the checkpoint resumed from, else from this node's output folder; saved by each
    node's first rank once the first step has compiled. Each node's first rank says what it found."""

    def __init__(self, recipe: Recipe, ctx: Context, out_dir: Path, resumed: Path | None):
        self.on = recipe.model.compile and recipe.train.compile_cache and compile_cache.available()
        self.compiled = recipe.model.compile
        self.out_dir, self.ctx = out_dir, ctx
        self.first_here = resume.first_here()
        if self.on:
            said = compile_cache.load([p for p in (resumed, out_dir) if p is not None], ctx.device)
            if said and self.first_here:
                print(f"rank {ctx.rank}: {said}", flush=True)

    def after_first_step(self) -> None:
        if self.on and self.first_here:
            said = compile_cache.save(self.out_dir, self.ctx.device)
            if said:
                print(f"rank {self.ctx.rank}: {said}", flush=True)
        broken = graph_breaks() if self.compiled and self.ctx.rank == 0 else None
        if broken:
            print(broken, flush=True)


class Profiler:
    """torch.profiler over the one step train.profile_at names; rank 0 writes profile.txt after it."""

    def __init__(self, at: int, ctx: Context, out_dir: Path) -> None:
        self.at, self.ctx, self.out_dir, self.running = at, ctx, out_dir, None

    def before(self, done: int) -> None:
        if self.at == done:
            self.running = _start_profile(self.ctx)

    def after(self, done: int, last: bool) -> None:
        if self.running is not None and (done == self.at + 1 or last):
            _finish_profile(self.running, self.ctx, self.out_dir)
            self.running = None


class AdapterSaves:
    """The adapter saved every train.save_every steps (the last step's is the loop's own, after it)."""

    def __init__(self, recipe: Recipe, model, out_dir: Path) -> None:
        self.every, self.keep, self.model, self.out_dir = recipe.train.save_every, recipe.train.keep_last, model, out_dir

    def due(self, done: int) -> bool:
        return bool(self.every) and done % self.every == 0

    def after(self, done: int, last: bool) -> None:
        if self.due(done) and not last:
            checkpoint.save_adapter(self.model, self.out_dir, done, self.keep)


class TermRequest:
    """SIGTERM (`nodectl stop`, fail-fast, a scheduler) noted, not obeyed at once: the loop checkpoints at its next
    logging step, when every rank agrees (Deadline.check), then exits 143. A rank stuck elsewhere is SIGKILLed
    after stop's --grace as before; a checkpoint cut short is never taken as complete."""

    def __init__(self) -> None:
        self.asked = False
        try:
            signal.signal(signal.SIGTERM, self._note)
        except ValueError:   # not the main thread (a test harness): SIGTERM keeps its default
            pass

    def _note(self, signum, frame) -> None:
        self.asked = True


class Deadline:
    """A checkpoint due by the wall clock (rank 0's clock) or a stop asked on any rank, decided the same on every
    rank, asked only at logging steps so that it costs one small collective per log window."""

    def __init__(self, minutes: float, ctx: Context) -> None:
        self.minutes, self.ctx, self.started = minutes, ctx, time.monotonic()

    def check(self, stop_asked: bool, failed: bool = False) -> tuple[bool, bool, bool]:
        """(a timed checkpoint is due, a rank was asked to stop, a background checkpoint write failed)."""
        due = bool(self.minutes) and self.ctx.rank == 0 and time.monotonic() - self.started >= self.minutes * 60
        flags = torch.tensor([1.0 if due else 0.0, 1.0 if stop_asked else 0.0, 1.0 if failed else 0.0],
                             device=self.ctx.device)
        if self.ctx.world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        due, stop, failed = flags.tolist()
        return bool(due), bool(stop), bool(failed)


def _checkpoint(recipe: Recipe, ctx: Context, model, parallel: Parallel, optimizer, step: int, out_dir: Path,
                reporter) -> None:
    started = time.perf_counter()
    saved_to = resume.save(model, optimizer, step, out_dir / "checkpoints", ctx.device, recipe.train.keep_checkpoints,
                           extra={"schedule_steps": recipe.train.steps}, layout=parallel.layout,
                           make_room=recipe.train.make_room)
    size = sum(f.stat().st_size for f in saved_to.glob("rank*.pt"))
    seconds = round(time.perf_counter() - started, 3)
    if reporter is not None:   # checkpoint_every's: an event in metrics.jsonl, as always
        reporter.event({"step": step, "checkpoint_s": seconds, "checkpoint_bytes_node": size})
    elif ctx.rank == 0:        # the timed and final ones: a line in the log, metrics.jsonl keeps its records
        print(f"checkpoint at step {step} in {seconds:.2f}s: {saved_to}", flush=True)


def _resume(recipe: Recipe, ctx: Context, model, parallel: Parallel, optimizer,
            out_dir: Path) -> tuple[int, Path | None]:
    """The step training continues from (0: the start), and the checkpoint it was read from."""
    choice = recipe.train.resume
    attempt = int(os.environ.get("NODECTL_ATTEMPT", "0") or 0)
    if choice == "none":
        return 0, None
    found = resume.agreed_latest(out_dir / "checkpoints", ctx.device) if choice == "auto" \
        else Path(os.path.expanduser(choice))
    if found is None:
        if attempt and ctx.rank == 0:   # a --resume or a restart that cannot continue says so before it trains
            kept = _keep_previous_adapter(out_dir, attempt)
            print(f"attempt {attempt}: no checkpoint in {out_dir / 'checkpoints'}, so training starts again from "
                  f"step 0" + (f"; the previous attempt's adapter is kept as {kept}" if kept else ""), flush=True)
        return 0, None
    if not (found / resume.COMPLETE).exists():
        raise ConfigError(f"train.resume: {found} is not a complete checkpoint")
    try:
        step = resume.load(model, optimizer, found, ctx.device, parallel.layout)
    except resume.ResumeError as exc:
        raise ConfigError(f"train.resume: {exc}") from None
    before = json.loads((found / resume.COMPLETE).read_text()).get("schedule_steps")
    if ctx.rank == 0 and isinstance(before, int) and before != recipe.train.steps:
        # the cosine schedule runs over train.steps: a longer run's learning rate at this step is higher than where
        # the shorter schedule had brought it (README, "Resuming")
        print(f"train.steps is {recipe.train.steps} (was {before}): the learning rate follows the schedule of "
              f"{recipe.train.steps} steps from step {step}, {lr_at(step, recipe):.1e} now (the old one ended at "
              f"{lr_at(before - 1, replace(recipe, train=replace(recipe.train, steps=before))):.1e})", flush=True)
    return step, found


def _counted_step(recipe, ctx, model, parallel: Parallel, optimizer, params, batches, step: int, window,
                  reporter) -> None:
    """One step with its collectives counted (trainer/traffic.py), summed over the ranks, and logged per GPU
    beside what the layout says it sends (layout.traffic)."""
    from . import traffic

    with traffic.counting() as counter:
        _train_step(recipe, ctx, model, optimizer, params, batches, step, window)
    sent = torch.tensor([counter.intra, counter.inter, float(counter.calls)], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(sent)
    layout, shape = parallel.layout, parallel.shape
    expected = layouts.traffic(layout, shape, recipe.model.reshard_after_forward)
    whole_world = layouts.traffic(layouts.Layout("fsdp", layout.world, layout.nodes, layout.per_node, ""), shape,
                                  recipe.model.reshard_after_forward)
    expected["fsdp_inter_node_bytes"] = whole_world["inter_node_bytes"]   # what sharding over every rank would send
    if recipe.train.grad_accum != 1:
        expected = {key: None for key in expected}   # the layout's figures are for one micro-batch per step
    reporter.event({"event": "traffic", "step": step + 1, "layout": layout.name,
                    "nodes": layout.nodes, "gpus_per_node": layout.per_node,
                    "counted_intra_node_bytes": sent[0].item() / ctx.world,
                    "counted_inter_node_bytes": sent[1].item() / ctx.world,
                    "collectives_per_rank": sent[2].item() / ctx.world,
                    **{f"layout_{key}": value for key, value in expected.items()}})


def _start_profile(ctx: Context):
    from torch.profiler import ProfilerActivity, profile

    profiler = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.on_gpu else []))
    profiler.__enter__()
    return profiler


def _finish_profile(profiler, ctx: Context, out_dir: Path) -> None:
    """Rank 0 writes the profiled steps' operations by GPU time (CPU time on CPU ranks) to profile.txt."""
    profiler.__exit__(None, None, None)
    if ctx.rank == 0:
        key = "self_device_time_total" if ctx.on_gpu else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=70)
        (out_dir / "profile.txt").write_text(table)


def _to_device(batch: dict[str, torch.Tensor], ctx: Context) -> dict[str, torch.Tensor | None]:
    """Pinned, asynchronous copies; no attention mask when nothing is padded (checked on the host), so the
    model takes the causal kernel without looking at a mask (which would cost a device-to-host sync)."""
    unpadded = bool(batch["attention_mask"].all()) or "position_ids" in batch  # packed: documents by position
    out = {k: (v.pin_memory() if ctx.on_gpu else v).to(ctx.device, non_blocking=True) for k, v in batch.items()
           if not (k == "attention_mask" and unpadded)}
    out.setdefault("attention_mask", None)
    return out


def _train_step(recipe, ctx, model, optimizer, params, batches, step: int, window: torch.Tensor) -> None:
    """One optimizer step over this rank's micro-batches; accumulates (loss sum, targets, real tokens) on device.
    Nothing here waits for the GPU: the host prepares the next step while this one runs."""
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, recipe)
    started = time.perf_counter()   # the data wait: the step's batches collated and sent to the device
    host_batches = batches.micro_batches(step)
    lengths = [mb["attention_mask"].sum(dim=1) for mb in host_batches]
    real_tokens = sum(int(rows.sum()) for rows in lengths)
    squared_lengths = sum(float((rows.double() ** 2).sum()) for rows in lengths)
    micro_batches = [_to_device(mb, ctx) for mb in host_batches]
    batches.waited += time.perf_counter() - started
    local_targets = sum((mb["labels"][:, 1:] != IGNORE).sum() for mb in micro_batches)
    global_targets = local_targets.clone().float()
    dist.all_reduce(global_targets)  # the loss is normalised by every target token of the global batch
    for index, mb in enumerate(micro_batches):
        model.set_requires_gradient_sync(index == len(micro_batches) - 1)
        loss_sum = model.loss_sum(mb["input_ids"], mb["attention_mask"], mb["labels"], mb.get("position_ids"))
        (loss_sum * ctx.world / global_targets).backward()  # FSDP averages gradients over ranks
        window[0] += loss_sum.detach()
    window[1] += local_targets
    window[2] += real_tokens
    window[3] += squared_lengths
    window.grad_norm = torch.nn.utils.clip_grad_norm_(params, recipe.train.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def _save_probe(model, batch: dict, ctx: Context, out_dir: Path) -> None:
    """Every rank runs the forward (FSDP needs them all); rank 0 keeps the logits of its batch."""
    model.eval()
    inputs = {k: v.to(ctx.device) for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits.float().cpu()
    if hasattr(model, "reshard"):
        model.reshard()
    model.train()
    if ctx.rank == 0:
        torch.save({**{k: v.cpu() for k, v in inputs.items()}, "logits": logits}, out_dir / "probe.pt")


def _reduce_window(ctx, step, window, window_start, steps, optimizer, flops, peak) -> dict:
    """The only host synchronisation of the loop: one all-reduce of (loss sum, target tokens, real tokens).

    The clock is read after `tolist()` has waited for that all-reduce, which the stream runs after every queued
    step of the window: the window's time is what the GPU took, as a user's wall clock sees it. (Read before the
    sync, the clock missed the work still queued, ~0.2 s per window on an 8B model.)"""
    totals = window.clone()
    dist.all_reduce(totals)
    loss_sum, target_tokens, real_tokens, squared_lengths = totals.tolist()
    clock, wall = time.perf_counter(), time.time()
    elapsed = clock - window_start
    per_gpu = real_tokens / elapsed / ctx.world
    norm = window.grad_norm
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return {
        "step": step + 1, "loss": loss_sum / max(target_tokens, 1.0), "lr": optimizer.param_groups[0]["lr"],
        "grad_norm": float(norm), "tokens_per_s_per_gpu": per_gpu, "step_time_s": elapsed / steps,
        "mfu": flops(real_tokens, squared_lengths, causal=False) / elapsed / ctx.world / peak if peak else None,
        "mfu_causal": flops(real_tokens, squared_lengths, causal=True) / elapsed / ctx.world / peak if peak else None,
        "max_memory_gb": torch.cuda.max_memory_allocated(ctx.device) / 1e9 if ctx.on_gpu else None,
        "real_tokens": int(real_tokens), "time": wall, "_clock": clock,
    }


def _keep_previous_adapter(out_dir: Path, attempt: int) -> Path | None:
    """An earlier attempt's adapter, moved out of the way of this attempt's saves (which would rotate it out)."""
    link = out_dir / "adapter"
    if not link.is_symlink():
        return None
    target = out_dir / os.readlink(link)
    kept = out_dir / f"previous-attempt-{attempt - 1}"
    if not target.is_dir() or kept.exists():
        return None
    os.replace(target, kept)
    link.unlink()
    return kept
