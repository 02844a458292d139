"""env-dump's judgement-free part: flattening reports and finding what differs between nodes."""
from __future__ import annotations

from typing import Any, Mapping

from nodectl.probe_report import Environment, ProbeReport

# Facts that differ on every run or every machine by nature; --diff leaves them out so real drift stands out.
VOLATILE_PREFIXES = (
    "clock.", "elapsed_s", "memory.available_bytes", "disk.free_bytes", "node.", "os.hostname",
    "python.executable", "python.prefix",
)
VOLATILE_PARTS = (".memory_used_bytes", ".uuid", ".pci_bus_id", ".compute_processes", ".addresses")


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": [1, {"c": 2}]}} -> {"a.b.0": 1, "a.b.1.c": 2}. NICs are keyed by name, not position."""
    if isinstance(value, Mapping):
        items = value.items()
    elif isinstance(value, list) and value and all(isinstance(v, Mapping) and "name" in v for v in value):
        items = ((v["name"], {k: x for k, x in v.items() if k != "name"}) for v in value)
    elif isinstance(value, list) and value:
        items = enumerate(value)
    else:
        return {prefix: value} if prefix else {}
    out: dict[str, Any] = {}
    for key, item in items:
        out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _volatile(key: str) -> bool:
    return key.startswith(VOLATILE_PREFIXES) or any(part in key for part in VOLATILE_PARTS) \
        or (key.startswith("env.") and key.split(".", 1)[1] in _VOLATILE_ENV)


_VOLATILE_ENV = {"SSH_CLIENT", "SSH_CONNECTION", "PWD", "OLDPWD", "_", "SHLVL"}


# What a training run depends on most comes first in --diff; the long tail of packages and environment last.
FIRST = ("torch.", "gpus.driver", "gpus.cuda_driver", "python.version", "packages.torch", "packages.nvidia-nccl",
         "os.kernel", "gpus.", "infiniband.")
LAST = ("packages.", "env.")


def _order(key: str) -> tuple[int, int, str]:
    first = next((i for i, prefix in enumerate(FIRST) if key.startswith(prefix)), None)
    if first is not None:
        return 0, first, key
    return (2 if key.startswith(LAST) else 1), 0, key


def diff_reports(reports: Mapping[str, Mapping]) -> dict[str, dict[str, Any]]:
    """{dotted key: {node: value}} for every key whose value is not the same on all nodes (missing counts): the
    versions a run depends on first (torch, driver, CUDA, NCCL, Python), packages and environment last."""
    flat = {node: flatten(report) for node, report in reports.items()}
    keys = sorted(set().union(*(f.keys() for f in flat.values())), key=_order) if flat else []
    differing = {}
    for key in keys:
        if _volatile(key):
            continue
        values = {node: f.get(key, "<missing>") for node, f in flat.items()}
        if len({repr(v) for v in values.values()}) > 1:
            differing[key] = values
    return differing


def summary_row(report: Mapping) -> dict[str, str]:
    """The key facts of one report, for env-dump's table."""
    typed = ProbeReport.of(report)
    gpus = typed.gpus.devices
    named = [g for g in gpus if g.name is not None]
    gpu_text = (f"{len(gpus)}x {named[0].name}" if named else f"{len(gpus)} unreadable") if gpus else "none"
    memory = typed.memory.total_bytes
    container, torch = typed.container, typed.torch
    host = ProbeReport.of(typed.raw.get("host") or {})   # in a container: the host's own python and torch
    return {
        "os": _cell(typed.os.distribution), "kernel": _cell(typed.os.kernel),
        "cpus": _cell(typed.cpu.count), "memory": f"{memory / 2**30:.0f} GiB" if memory else "-",
        "python": _cell(typed.python.version), "torch": _cell(torch.version),
        "cuda": _cell(torch.cuda), "nccl": _cell(torch.nccl),
        "driver": _cell(typed.gpus.driver), "gpus": gpu_text,
        # ranks in a container: python/torch above are the image's; the host's own beside them
        "image": f"{_cell(container.runtime)}: {_cell(container.image)}" if container else "-",
        "host python/torch": f"{_cell(host.python.version)} / {_cell(host.torch.version)}" if container else "-",
        "environment": _environment_cell(typed.environment),
    }


def _cell(value) -> str:
    return "-" if value is None else str(value)


def _environment_cell(facts: Environment | None) -> str:
    """A node's locked venv for env-dump's table: its key and whether it is there, unchanged."""
    if facts is None:
        return "-"
    state = "unchanged" if facts.intact else "CHANGED" if facts.present else "not built"
    return f"{facts.key} ({state})"
