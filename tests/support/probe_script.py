"""launchers/probe.py as a module, the way a node runs it: the one script probe_source() assembles (the redaction
rules put in place of its `from redaction import` line), so a test imports nothing a node would not have."""
from __future__ import annotations

import types


def load() -> types.ModuleType:
    from nodectl.remote.probe_nodes import probe_source

    module = types.ModuleType("nodectl_probe_script")
    exec(compile(probe_source(), "launchers/probe.py", "exec"), module.__dict__)
    return module
