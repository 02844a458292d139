"""Secret redaction (docs/REFERENCE.md: never print or store a secret). The rules live in launchers/probe.py, which runs on
nodes and may import nothing from nodectl; the controller loads that very file so there is one set of rules."""
from __future__ import annotations

import importlib.util

from nodectl.resources import resource_dir


def _load_probe():
    spec = importlib.util.spec_from_file_location("nodectl_probe_rules", resource_dir("launchers") / "probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_probe = _load_probe()
REDACTED, is_secret_name, redact_args, redact_env, redact_value, redact_text, redact_words = (
    _probe.REDACTED, _probe.is_secret_name, _probe.redact_args, _probe.redact_env, _probe.redact_value,
    _probe.redact_text, _probe.redact_words)

__all__ = ["REDACTED", "is_secret_name", "redact_args", "redact_env", "redact_text", "redact_tree", "redact_value",
           "redact_words"]


def redact_tree(value):
    """Every string in a JSON-shaped value through redact_words (a saved diagnosis, say)."""
    if isinstance(value, str):
        return redact_words(value)
    if isinstance(value, list):
        return [redact_tree(v) for v in value]
    if isinstance(value, dict):
        return {k: redact_tree(v) for k, v in value.items()}
    return value
