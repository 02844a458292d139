"""Host ranges as pdsh and clush write them: `node[01-16,20]` names node01 ... node16 and node20 (zero padding
kept); several bracket groups multiply (`rack[1-2]-gpu[1-4]`: 8 names). `fold` writes a set of names back in
that form, as dshbak -c does for nodes with identical output."""
from __future__ import annotations

import itertools
import re

from nodectl.errors import UsageError

MAX_EXPANSION = 10_000
_GROUP = re.compile(r"\[([^\[\]]*)\]")
_FOLDABLE = re.compile(r"^(.*?)(\d+)(\D*)$")


def _parse_group(body: str, pattern: str) -> list[str]:
    items = []
    for part in body.split(","):
        part = part.strip()
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise UsageError(f"host range {pattern!r}: {part!r} is not a number or a range like 01-16")
        if not dash:
            items.append(low)
            continue
        start, stop = int(low), int(high)
        if stop < start:
            raise UsageError(f"host range {pattern!r}: {part!r} runs backwards")
        if stop - start >= MAX_EXPANSION:
            raise UsageError(f"host range {pattern!r}: {part!r} names more than {MAX_EXPANSION} hosts")
        width = len(low) if low.startswith("0") and len(low) > 1 else 0
        items.extend(str(n).zfill(width) for n in range(start, stop + 1))
    return items


def expand(pattern: str) -> list[str]:
    """Every name a pattern stands for, in order; a name without brackets stands for itself."""
    groups = [_parse_group(m.group(1), pattern) for m in _GROUP.finditer(pattern)]
    if not groups:
        if "[" in pattern or "]" in pattern:
            raise UsageError(f"host range {pattern!r}: unbalanced brackets")
        return [pattern]
    literals = _GROUP.split(pattern)[::2]
    if any("[" in text or "]" in text for text in literals):
        raise UsageError(f"host range {pattern!r}: unbalanced or nested brackets")
    total = 1
    for group in groups:
        total *= len(group)
    if total > MAX_EXPANSION:
        raise UsageError(f"host range {pattern!r} names {total} hosts; at most {MAX_EXPANSION}")
    names = []
    for combination in itertools.product(*groups):
        names.append("".join(itertools.chain.from_iterable(itertools.zip_longest(literals, combination,
                                                                                  fillvalue=""))))
    return names


def split(text: str) -> list[str]:
    """A comma-separated list whose items may themselves hold commas inside brackets: `a,node[1,3-4],b`."""
    items, depth, current = [], 0, []
    for char in text:
        if char == "," and depth == 0:
            items.append("".join(current))
            current = []
            continue
        depth += {"[": 1, "]": -1}.get(char, 0)
        current.append(char)
    items.append("".join(current))
    return [item.strip() for item in items if item.strip()]


def expand_list(text: str) -> list[str]:
    return [name for item in split(text) for name in expand(item)]


def fold(names: list[str]) -> str:
    """The shortest usual writing of a set of names: `node[01-03,05],login`."""
    series: dict[tuple[str, str, int], list[int]] = {}
    plain, parsed = [], []
    for name in names:
        match = _FOLDABLE.match(name)
        if match:
            parsed.append(match.groups())
        else:
            plain.append(name)
    padded = {(prefix, suffix, len(digits)) for prefix, digits, suffix in parsed
              if digits.startswith("0") and len(digits) > 1}
    for prefix, digits, suffix in parsed:  # gpu09 and gpu10 are one series of width 2
        width = len(digits) if (prefix, suffix, len(digits)) in padded else 0
        series.setdefault((prefix, suffix, width), []).append(int(digits))
    parts = []
    for (prefix, suffix, width), numbers in series.items():
        numbers = sorted(set(numbers))
        if len(numbers) == 1:
            parts.append(f"{prefix}{str(numbers[0]).zfill(width)}{suffix}")
            continue
        spans, start = [], numbers[0]
        for previous, current in zip(numbers, numbers[1:] + [None]):
            if current != previous + 1:
                low, high = str(start).zfill(width), str(previous).zfill(width)
                spans.append(low if start == previous else f"{low}-{high}")
                start = current
        parts.append(f"{prefix}[{','.join(spans)}]{suffix}")
    return ",".join(parts + plain)
