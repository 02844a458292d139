"""The recipe: YAML parsed once into dataclasses, checked before any process group exists."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

LAYOUTS = ("auto", "replicate", "hsdp", "fsdp", "expert", "expert-global")  # model.parallelism; trainer/layout.py
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class ConfigError(Exception):
    """A recipe problem: names the key and what was expected."""


@dataclass(frozen=True)
class ModelConfig:
    path: str = "demo"                 # a local folder with config.json, tokenizer and safetensors; or "demo"
    dtype: str = "auto"                # auto: bf16 on GPUs, fp32 on CPU ranks
    activation_checkpointing: bool | float | str = True  # true, false, the share of decoder layers (0.25), or
                                       # auto: the least that fits beside the micro-batch (trainer/layout.py plan)
    compile: bool = False              # torch.compile each decoder layer's forward
    compile_numerics: str = "eager"    # eager: fused kernels round to bf16 where eager PyTorch does, so the
                                       # loss curve is eager's; fused: Inductor's fp32 between fused ops (~2% faster)
    reshard_after_forward: bool = True # false: keep each layer's gathered weights from forward to backward
                                       # (one all-gather per layer and step instead of two; +1/world of the model)
    load: str = "sliced"               # sliced: each rank reads only its own shards from its node's copy of path;
                                       # broadcast: rank 0 reads every weight and sends each rank its shards
    init: str = "checkpoint"           # checkpoint: the weights in path; random: for benchmarks, each rank fills
                                       # its own shards at random (path needs only config.json and a tokenizer)
    moe_kernel: str = "grouped"        # routed-expert LoRA: grouped (base and adapter as grouped GEMMs on the routed
                                       # tokens, no B@A formed; trainer/moe.py) or peft (peft's ParamWrapper: the
                                       # whole expert stack's W + B@A on every forward)
    expert_lora_kernel: str = "auto"   # the grouped path's adapter products: triton (trainer/expert_lora.py, one
                                       # kernel per tile for the forward and one for the input gradient), torch
                                       # (torch's grouped GEMMs, six launches), auto: torch (measured faster in the
                                       # compiled trainer, A B B A; trainer/moe.py lora_kernel)
    fp8_experts: bool = False          # the routed experts' frozen base as e4m3 with per-channel scales (grouped
                                       # path, Hopper GPUs; layouts that keep experts unsharded by FSDP:
                                       # replicate, expert); adapters and gradients stay bf16 (trainer/fp8.py)
    expert_parallel: bool = False      # routed experts split over the ranks (E/world each, never all-gathered;
                                       # tokens travel to them by all_to_all); the rest FSDP as usual. The same
                                       # as parallelism: expert-global
    parallelism: str = "auto"          # auto, replicate, hsdp, fsdp, expert, expert-global (trainer/layout.py):
                                       # auto picks by memory and node count and prints what and why
    expert_exchange: str = "host"      # expert layouts whose group gathers (up to top-k ranks): host (the count of
                                       # this rank's copies read on the host, only those computed) or graph (the
                                       # collectives inside the compiled layer, nothing read on the host, every
                                       # copy of the group through the row-wise steps; trainer/moe.py)

    @property
    def layout(self) -> str:
        """model.parallelism, with expert_parallel: true as expert-global."""
        return "expert-global" if self.expert_parallel and self.parallelism == "auto" else self.parallelism


@dataclass(frozen=True)
class LoraConfig:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    target_parameters: tuple[str, ...] = ("auto",)  # fused MoE expert weights (3-D, experts first), adapted through
                                       # peft's target_parameters: auto, every one the model has; none; or names
                                       # such as mlp.experts.gate_up_proj
    expert_r: int = 0                  # LoRA rank of each expert in those (peft gives every expert its own rank-r
                                       # factors, so a fused weight's adapter is experts x r); 0: lora.r


@dataclass(frozen=True)
class DataConfig:
    path: str = "demo"                 # JSONL, Parquet, a datasets save_to_disk folder or a glob of shards, with
                                       # {"messages"}, {"prompt", "response"} or {"text"} records; or "demo"
    max_length: int = 128
    overlong: str = "truncate"         # an example over max_length tokens: truncate or drop (counted in the log)
    packing: bool = False              # whole examples per row, attention and positions per document
    seed: int = 0
    eval_path: str = ""                # held-out JSONL; or hold out eval_holdout examples of path
    eval_holdout: int = 0
    eval_samples: int = 64             # the deterministic subset evaluated each time


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 60
    micro_batch_size: int | str = 8    # rows per rank and forward; auto: the split of train.batch_size estimated
                                       # fastest among those that fit, the rest accumulated (printed with why)
    grad_accum: int = 1
    batch_size: int = 0                # rows per rank and step, for micro_batch_size: auto (else micro x accum)
    lr: float = 3e-3
    warmup_steps: int = 5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    seed: int = 0
    log_every: int = 5
    save_every: int = 0                # 0: only at the end
    keep_last: int = 2
    output_dir: str = ""               # default: $NODECTL_RUN_DIR/output, else ./output
    collective_timeout_s: float = 600.0
    save_probe_logits: bool = False    # rank 0 writes probe.pt: one batch's logits, to verify an exported adapter
    eval_every: int = 0                # 0: no evaluation
    eval_at_start: bool = False
    checkpoint_every: int = 0          # a full checkpoint (exact resume) every N steps; 0: by time only
    checkpoint_minutes: float = 30.0   # and one at least this often by the wall clock, and one at the end, so that
                                       # --resume and --max-restarts continue; 0: only checkpoint_every's
    keep_checkpoints: int = 2
    make_room: bool = False            # a checkpoint that would not fit drops the oldest kept ones first (never the
                                       # newest complete one); without it the trainer says so before it writes
    async_checkpoint: bool | str = "auto"  # write checkpoints in the background: training waits only while the state
                                       # is copied to (pinned) host memory; auto: on GPUs, where that copy is fast;
                                       # falls back to writing while training waits where host memory is short
    compile_cache: bool = True         # with model.compile: the compiled graphs and kernels kept in the output folder
                                       # and in each checkpoint, loaded by later attempts, resumes and joining nodes
    resume: str = "auto"               # auto: the latest complete checkpoint in the output folder; none; or a path
    early_stop_patience: int = 0       # stop after this many evaluations without improvement; 0: never
    early_stop_min_delta: float = 0.0
    export: str = ""                   # after training, rank 0 writes: merged (the base with the adapter folded in, HF
                                       # safetensors, output/merged) and/or vllm (the adapter in checkpoint names,
                                       # experts split, output/adapter-vllm); comma-separated
    tensorboard: bool = False          # rank 0 writes the logged metrics to output/tensorboard (needs tensorboard)
    wandb_project: str = ""            # rank 0 logs metrics and the recipe to this W&B project (needs wandb; the
                                       # key comes from WANDB_API_KEY in the node's env, WANDB_MODE=offline works)
    profile_at: int = 0                # profile steps profile_at and profile_at+1 (torch.profiler); rank 0 writes
                                       # output/profile.txt, ops by GPU time; 0: never
    traffic_at: int = 0                # count the bytes step traffic_at's collectives send (inside and across nodes)
                                       # beside the layout's own figure: one 'traffic' record in metrics.jsonl


@dataclass(frozen=True)
class Recipe:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def output_dir(self) -> Path:
        if self.train.output_dir:
            return Path(os.path.expanduser(self.train.output_dir))
        run_dir = os.environ.get("NODECTL_RUN_DIR")
        return Path(run_dir) / "output" if run_dir else Path("output")


SECTIONS = {"model": ModelConfig, "lora": LoraConfig, "data": DataConfig, "train": TrainConfig}


def _switch_or_auto(value: Any) -> bool | str | None:
    """true/false (yes/no), or auto; None for anything else."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no"):
        return value.lower() in ("true", "yes")
    return None


def _coerce(section: str, spec: dataclasses.Field, value: Any) -> Any:
    key, kind = f"{section}.{spec.name}", spec.type
    if kind == "int | str":     # a count or auto
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected a positive integer or auto, got {value!r}")
    switch = _switch_or_auto(value) if kind in ("bool | float | str", "bool | str") else None
    if switch is not None:
        return switch
    if kind == "bool | float | str":  # a switch, a share, or auto
        try:
            share = float(value)
        except (TypeError, ValueError):
            share = -1.0
        if 0.0 <= share <= 1.0:
            return share
        raise ConfigError(f"{key}: expected true, false, a share of the layers from 0 to 1 or auto, got {value!r}")
    if kind == "bool | str":    # a switch or auto
        raise ConfigError(f"{key}: expected true, false or auto, got {value!r}")
    if kind == "bool":
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if isinstance(value, bool):
            return value
    elif kind == "int":
        if isinstance(value, str) and value.lstrip("-").isdigit():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind == "float":
        try:
            if not isinstance(value, bool):
                return float(value)
        except (TypeError, ValueError):
            pass
    elif kind == "str":
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    elif kind.startswith("tuple"):
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return tuple(value)
    raise ConfigError(f"{key}: expected {kind}, got {value!r}")


def _set_override(document: dict, assignment: str) -> None:
    if "=" not in assignment or "." not in assignment.split("=", 1)[0]:
        raise ConfigError(f"--set {assignment!r}: expected section.key=value, e.g. train.steps=100")
    dotted, raw = assignment.split("=", 1)
    section, key = dotted.split(".", 1)
    document.setdefault(section, {})
    if not isinstance(document[section], dict):
        raise ConfigError(f"{section}: expected a mapping")
    document[section][key] = yaml.safe_load(raw) if raw else ""


DEMO_RECIPE = Path(__file__).with_name("demo.yaml")


def load_recipe(path: str | None, overrides: list[str] = (), node_files: bool = True) -> Recipe:
    """The recipe at `path` (the built-in demo recipe when None) with `section.key=value` overrides.
    node_files=False skips the checks of model and data paths, which name files on the nodes (nodectl checks
    a recipe on the controller before any node is touched)."""
    path = path or str(DEMO_RECIPE)
    document: Any = {}
    if path:
        try:
            document = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"recipe {path}: cannot be read ({exc.strerror})") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"recipe {path}: not valid YAML ({exc})") from None
    if not isinstance(document, dict):
        raise ConfigError(f"recipe {path}: expected a mapping with sections {', '.join(SECTIONS)}")
    for assignment in overrides:
        _set_override(document, assignment)
    built = {}
    for section, values in document.items():
        if section not in SECTIONS:
            raise ConfigError(f"{section}: unknown section; expected one of {', '.join(SECTIONS)}")
        if not isinstance(values, dict):
            raise ConfigError(f"{section}: expected a mapping of settings")
        known = {f.name: f for f in fields(SECTIONS[section])}
        for key in values:
            if key not in known:
                raise ConfigError(f"{section}.{key}: unknown key; expected one of {', '.join(known)}")
        built[section] = SECTIONS[section](**{k: _coerce(section, known[k], v) for k, v in values.items()})
    recipe = Recipe(**built)
    _check(recipe, node_files)
    return recipe


def exports(recipe: Recipe) -> list[str]:
    return [kind.strip() for kind in recipe.train.export.split(",") if kind.strip()]


def _check(recipe: Recipe, node_files: bool = True) -> None:
    positive = {"train.steps": recipe.train.steps, "train.micro_batch_size": recipe.train.micro_batch_size,
                "train.grad_accum": recipe.train.grad_accum, "data.max_length": recipe.data.max_length,
                "lora.r": recipe.lora.r, "train.log_every": recipe.train.log_every,
                "train.keep_last": recipe.train.keep_last}
    for key, value in positive.items():
        if value != "auto" and value < 1:
            raise ConfigError(f"{key}: expected a positive integer, got {value}")
    if recipe.train.micro_batch_size == "auto":
        if recipe.train.batch_size < 1:
            raise ConfigError("train.micro_batch_size: auto splits train.batch_size (rows per rank and step) into "
                              "micro-batches: set train.batch_size")
        if recipe.train.grad_accum != 1:
            raise ConfigError("train.micro_batch_size: auto chooses the accumulation from train.batch_size; leave "
                              "train.grad_accum unset")
    elif recipe.train.batch_size and recipe.train.batch_size != recipe.train.micro_batch_size * recipe.train.grad_accum:
        raise ConfigError(f"train.batch_size: {recipe.train.batch_size} rows per step is not train.micro_batch_size "
                          f"x train.grad_accum ({recipe.train.micro_batch_size} x {recipe.train.grad_accum}); set "
                          f"train.micro_batch_size: auto to split it, or leave it unset")
    for section in ("model", "lora", "data", "train"):
        for key, value in vars(getattr(recipe, section)).items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{section}.{key}: expected a finite number, got {value}")
    if not 0 <= recipe.train.checkpoint_minutes < float("inf"):
        raise ConfigError(f"train.checkpoint_minutes: expected minutes >= 0, got {recipe.train.checkpoint_minutes}")
    if (recipe.train.early_stop_patience or recipe.train.eval_at_start) and not (recipe.train.eval_every and
                                                                              (recipe.data.eval_path or recipe.data.eval_holdout)):
        raise ConfigError("train.early_stop_patience / eval_at_start: need train.eval_every and data.eval_holdout "
                          "or data.eval_path")
    if recipe.model.dtype not in ("auto", "bfloat16", "float32"):
        raise ConfigError(f"model.dtype: expected auto, bfloat16 or float32, got {recipe.model.dtype!r}")
    if recipe.model.init not in ("checkpoint", "random"):
        raise ConfigError(f"model.init: expected checkpoint or random, got {recipe.model.init!r}")
    if recipe.model.moe_kernel not in ("grouped", "peft"):
        raise ConfigError(f"model.moe_kernel: expected grouped or peft, got {recipe.model.moe_kernel!r}")
    if recipe.model.expert_lora_kernel not in ("auto", "triton", "torch"):
        raise ConfigError(f"model.expert_lora_kernel: expected auto, triton or torch, got "
                          f"{recipe.model.expert_lora_kernel!r}")
    if recipe.model.expert_exchange not in ("host", "graph"):
        raise ConfigError(f"model.expert_exchange: expected host or graph, got {recipe.model.expert_exchange!r}")
    if recipe.model.parallelism not in LAYOUTS:
        raise ConfigError(f"model.parallelism: expected one of {', '.join(LAYOUTS)}, got {recipe.model.parallelism!r}")
    if recipe.model.expert_parallel and recipe.model.parallelism not in ("auto", "expert-global"):
        raise ConfigError(f"model.expert_parallel: true is model.parallelism: expert-global; it contradicts "
                          f"model.parallelism: {recipe.model.parallelism} (set only one of them)")
    expert_key = "model.expert_parallel" if recipe.model.expert_parallel else "model.parallelism"
    if recipe.model.fp8_experts and recipe.model.moe_kernel != "grouped":
        raise ConfigError("model.fp8_experts: needs model.moe_kernel: grouped")
    if recipe.model.layout.startswith("expert") and recipe.model.moe_kernel != "grouped":
        raise ConfigError(f"{expert_key}: needs model.moe_kernel: grouped")
    if recipe.model.layout.startswith("expert") and recipe.model.load == "broadcast" and \
            recipe.model.init == "checkpoint":
        raise ConfigError(f"{expert_key}: each rank reads its own experts (model.load: sliced); "
                          "model.load: broadcast sends whole weights from rank 0")
    if recipe.model.load not in ("sliced", "broadcast"):
        raise ConfigError(f"model.load: expected sliced or broadcast, got {recipe.model.load!r}")
    if recipe.data.overlong not in ("truncate", "drop"):
        raise ConfigError(f"data.overlong: expected truncate or drop, got {recipe.data.overlong!r}")
    if recipe.model.compile_numerics not in ("eager", "fused"):
        raise ConfigError(f"model.compile_numerics: expected eager or fused, got {recipe.model.compile_numerics!r}")
    unknown = set(exports(recipe)) - {"merged", "vllm"}
    if unknown:
        raise ConfigError(f"train.export: expected merged and/or vllm, got {', '.join(sorted(unknown))}")
    if exports(recipe) and recipe.model.init == "random":
        raise ConfigError("train.export: model.init: random has no checkpoint to merge into or to name modules by")
    if recipe.lora.expert_r < 0:
        raise ConfigError(f"lora.expert_r: expected 0 (lora.r) or a positive rank, got {recipe.lora.expert_r}")
    if not 0 <= recipe.lora.dropout < 1:
        raise ConfigError(f"lora.dropout: expected 0 <= dropout < 1, got {recipe.lora.dropout}")
    problem = _chat_without_template(recipe)
    if problem:
        raise ConfigError(problem)
    if not node_files:
        return
    import importlib.util

    for key, on, package in (("train.tensorboard", recipe.train.tensorboard, "tensorboard"),
                             ("train.wandb_project", recipe.train.wandb_project, "wandb")):
        try:
            found = importlib.util.find_spec(package) is not None
        except (ImportError, ValueError):
            found = False
        if on and not found:
            raise ConfigError(f"{key}: the {package} package is not installed in this node's Python "
                              f"(pip install {package}, or leave {key} unset)")
    if recipe.model.path != "demo" and not (Path(os.path.expanduser(recipe.model.path)) / "config.json").is_file():
        raise ConfigError(f"model.path: {recipe.model.path} has no config.json (a local Hugging Face model "
                          f"folder is expected; nothing is downloaded)")
    if recipe.data.path != "demo" and not Path(os.path.expanduser(recipe.data.path)).is_file():
        raise ConfigError(f"data.path: {recipe.data.path} is not a file")


def _chat_without_template(recipe: Recipe) -> str | None:
    """Chat records for a model whose tokenizer has no chat template, where both can be read from here (on the
    controller: a project's data file and a model folder it also has). Elsewhere the ranks find it."""
    data = Path(os.path.expanduser(recipe.data.path))
    if recipe.data.path == "demo" or recipe.model.path == "demo" or data.suffix != ".jsonl" or not data.is_file():
        return None
    try:
        with open(data, encoding="utf-8") as handle:
            first = next((line for line in handle if line.strip()), "")
        if "messages" not in json.loads(first):
            return None
    except (OSError, ValueError, TypeError):
        return None
    folder = Path(os.path.expanduser(recipe.model.path))
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None   # the model folder is on the nodes only
    try:
        has_template = bool(json.loads(config.read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return None
    if has_template or (folder / "chat_template.jinja").is_file():
        return None
    return (f"data.path: {recipe.data.path} holds chat records ('messages'), but the tokenizer of "
            f"{recipe.model.path} has no chat template (tokenizer_config.json's chat_template or chat_template.jinja);"
            f" use a model that has one (model.path: demo has), or {{'prompt', 'response'}} records")
