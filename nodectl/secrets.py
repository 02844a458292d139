"""Secret redaction (docs/REFERENCE.md: never print or store a secret). The rules live in launchers/probe.py, which runs on
nodes and may import nothing from nodectl; the controller imports that very module, so there is one set of rules."""
from __future__ import annotations

from nodectl.resources.launchers import probe as _probe

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
