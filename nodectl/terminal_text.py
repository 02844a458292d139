"""Text from nodes (rank logs, error messages, file names) made safe for the user's terminal.

A rank's log or a node's answer may carry terminal escape sequences: a window-title or clipboard write (OSC 52), a
screen clear, a device-status query whose answer the terminal types into the shell. Everything but newlines, tabs
and colour (SGR: ESC [ ... m) is shown as a visible escape (`\\x1b]52;...`) instead of reaching the terminal.
"""
from __future__ import annotations

import re

_COLOUR = re.compile(r"\x1b\[[0-9;]{0,32}m")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


# what a progress bar (tqdm, rich, pip) draws with: cursor moves and line clears, and \r to go back to the start
_CURSOR = re.compile(r"\x1b\[[0-9;?]{0,32}[ABCDEFGJKsu]")


def rendered(line: str) -> str:
    """One log line as a terminal would leave it: a progress bar redraws itself after each \r, so what follows the
    last one (that is not empty) is what it shows; its cursor moves and line clears are dropped."""
    if "\r" in line:
        line = next((part for part in reversed(line.split("\r")) if part.strip()), "")
    return _CURSOR.sub("", line) if "\x1b" in line else line


def sized(count: float) -> str:
    """A byte count for people: 512 B, 12.3 KiB, 4.5 MiB, 1.2 GiB (never "0.0 MiB" for 40 KiB)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if count >= 1 << shift:
            return f"{count / (1 << shift):.1f} {unit}"
    return f"{int(count)} B"


def visible(text: str, colour: bool = True) -> str:
    """`text` with its control characters escaped; SGR colour kept when `colour`. A progress bar's redraws are
    rendered first (`rendered`): its last state is shown, not `\r` and cursor escapes."""
    text = rendered(text)
    if not _CONTROL.search(text):
        return text
    if not colour:
        return _CONTROL.sub(_escape, text)
    out, last = [], 0
    for match in _COLOUR.finditer(text):
        out.append(_CONTROL.sub(_escape, text[last:match.start()]))
        out.append(match.group(0))
        last = match.end()
    out.append(_CONTROL.sub(_escape, text[last:]))
    return "".join(out)


def _escape(match: re.Match) -> str:
    char = match.group(0)
    return f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"
