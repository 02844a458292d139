"""Reading and writing on the node's side, once: a helper's answer is one JSON object, its last line that is one (a
login banner or a log line may come before it), and a file is written whole under a new name, then renamed. Shipped
inside runctl's artifact and synced into lib/ beside runlayout.py; the controller imports the reader
(nodectl.resources.launchers.nodeio). Standard library only."""
from __future__ import annotations

import json
import os


def last_json(text: str):
    """The last line that is a JSON object, or None."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except (ValueError, RecursionError):   # an answer nested too deep is no answer
                continue
            if isinstance(value, dict):
                return value
    return None


def write_file(path: str, text: str, mode: int = 0o644) -> None:
    """Written whole under a new name, then renamed over `path` (a link planted at either name is replaced, never
    written through)."""
    tmp = f"{path}.tmp{os.getpid()}.{os.urandom(4).hex()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
