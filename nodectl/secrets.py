"""Secret redaction (SPEC: never print or store a secret). The rules live in launchers/probe.py, which runs on
nodes and may import nothing from nodectl; the controller uses the very same functions."""
from nodectl.resources.launchers.probe import REDACTED, is_secret_name, redact_env, redact_value

__all__ = ["REDACTED", "is_secret_name", "redact_env", "redact_value"]
