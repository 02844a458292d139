"""Files nodectl ships to nodes or renders: launchers/, templates/ and trainer/ from the repository root.

They are mapped into this package by pyproject.toml, so the same lookup works from a checkout, an editable
install and a wheel.
"""
from __future__ import annotations

import importlib.util
import sys
from importlib import resources
from pathlib import Path

# The built-in trainer's package name on a node (lib/nodectl_trainer, from trainer/ here): names starting with
# nodectl are nodectl's, so a user's own `trainer/` folder in the synced project cannot shadow it.
NODE_TRAINER = "nodectl_trainer"


def resource_dir(name: str) -> Path:
    """The folder of a shipped resource package ("launchers", "templates" or "trainer")."""
    try:
        return Path(str(resources.files(f"nodectl.resources.{name}")))
    except ModuleNotFoundError:  # a checkout on PYTHONPATH, not installed: the folders sit at the repo root
        return Path(__file__).resolve().parents[2] / name


def load_launcher(name: str):
    """A node-side module of launchers/ (standard library only, or what the node has), loaded here too where the
    controller does the same thing (collect --from-store pulls as a node does): one implementation, two places."""
    qualified = f"nodectl._launchers.{name}"
    if qualified not in sys.modules:
        spec = importlib.util.spec_from_file_location(qualified, resource_dir("launchers") / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[qualified] = module
        spec.loader.exec_module(module)
    return sys.modules[qualified]
