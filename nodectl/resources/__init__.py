"""Files nodectl ships to nodes or renders: launchers/, templates/ and trainer/ from the repository root.

They are mapped into this package by setup.py, so the same lookup works from a checkout, an editable install and
a wheel, and so does an import: the controller imports the node-side modules it shares (`from
nodectl.resources.launchers import redaction`: the redaction rules; `nodectl.resources.trainer.config`: the recipe),
never loads them by path. In a checkout run from its folder without an install (the GPU machine's PYTHONPATH), the
repository's root is added to this package's path, so the same imports find launchers/ and trainer/ there.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parents[2]
if not (Path(__file__).parent / "launchers").is_dir() and (_CHECKOUT / "launchers" / "__init__.py").is_file():
    __path__.append(str(_CHECKOUT))  # noqa: F821 - a package's own __path__

# The built-in trainer's package name on a node (lib/nodectl_trainer, from trainer/ here): names starting with
# nodectl are nodectl's, so a user's own `trainer/` folder in the synced project cannot shadow it.
NODE_TRAINER = "nodectl_trainer"


def resource_dir(name: str) -> Path:
    """The folder of a shipped resource package ("launchers", "templates" or "trainer")."""
    try:
        return Path(str(resources.files(f"nodectl.resources.{name}")))
    except ModuleNotFoundError:  # a checkout on PYTHONPATH, not installed: the folders sit at the repo root
        return Path(__file__).resolve().parents[2] / name
