"""The shape the inventory's sections share (`container:`, `environment:`, `outputs:`, in a node or in defaults):
null or false for none, a string as the shorthand for one key (`container: IMAGE`), or a mapping of known keys.
Each section's module checks its own keys after `section` has read that shape."""
from __future__ import annotations

from typing import Any, Callable, Collection, Mapping


def section(value: Any, label: str, fail: Callable[[str, str], None], *, shorthand: str, keys: Collection[str],
            shape: str) -> Mapping | None:
    """`value` as a mapping of `keys` (a string: {shorthand: value}), None for none; else `fail(key, expected)`
    (which raises) names the section (`shape` says what it takes) or the unknown key."""
    if value is None or value is False:
        return None
    if isinstance(value, str):
        value = {shorthand: value}
    if not isinstance(value, Mapping):
        fail(label, shape)
    for key in value:
        if key not in keys:
            fail(f"{label}.{key}", f"unknown key; expected one of {', '.join(sorted(keys))}")
    return value
