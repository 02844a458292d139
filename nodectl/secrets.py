"""Secret redaction (docs/REFERENCE.md: never print or store a secret). The rules are launchers/redaction.py's, which
the node's probe runs with too (it may import nothing from nodectl), so both sides hold one set of rules."""
from __future__ import annotations

from nodectl.resources.launchers.redaction import (REDACTED, is_secret_name, mask_url, redact_args, redact_env,
                                                   redact_text, redact_tree, redact_value, redact_words, url_secret)

__all__ = ["REDACTED", "is_secret_name", "mask_url", "redact_args", "redact_env", "redact_text", "redact_tree",
           "redact_value", "redact_words", "url_secret"]
