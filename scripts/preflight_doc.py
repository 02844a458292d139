"""Write docs/PREFLIGHT.md's table of checks from the checks' own declarations (`@check` in
nodectl/preflight/host.py, gpu.py, network.py, storage.py, cluster.py). tests/unit/test_preflight_registry.py
fails while the two differ; run this after adding or changing a check: python scripts/preflight_doc.py
(`--check`: only say whether the table is current, exit 1 when not)."""
from __future__ import annotations

import sys
from pathlib import Path

from nodectl.preflight.judge import DOC_HEADER, doc_table

DOC = Path(__file__).resolve().parents[1] / "docs" / "PREFLIGHT.md"


def replaced(text: str) -> str:
    """`text` with the table (from its header row to the first line that is not a row) replaced."""
    lines = text.split("\n")
    start = lines.index(DOC_HEADER[0])
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "\n".join(lines[:start] + doc_table().rstrip("\n").split("\n") + lines[end:])


if __name__ == "__main__":
    new = replaced(DOC.read_text())
    changed = new != DOC.read_text()
    if "--check" in sys.argv[1:]:
        print(f"{DOC}: {'differs from the checks' if changed else 'already current'}")
        sys.exit(1 if changed else 0)
    DOC.write_text(new)
    print(f"{DOC}: {'table rewritten' if changed else 'already current'}")
