"""/etc/hosts as a node reads it: the line that names a host. Shared by the probe (launchers/probe.py, into which
probe_source inlines it) and runctl (its artifact carries it beside the package)."""
from __future__ import annotations


def hosts_line(name: str, path: str = "/etc/hosts"):
    """The line of `path` that names `name`, as written (number and text), or None."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            for number, line in enumerate(handle, 1):
                words = line.split("#", 1)[0].split()
                if len(words) > 1 and name in words[1:]:
                    return {"line": number, "text": line.strip()[:200]}
    except OSError:
        pass
    return None
