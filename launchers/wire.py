"""What travels between the controller and a node's helpers: each answers one JSON object, its last line that is
one (a login banner or a log line may come before it). Shipped inside runctl's artifact beside runlayout.py and
imported by the controller (nodectl.resources.launchers.wire): one reader on both sides."""
from __future__ import annotations

import json


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
