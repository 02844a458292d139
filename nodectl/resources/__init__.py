"""Files nodectl ships to nodes or renders: launchers/, templates/ and trainer/ from the repository root.

They are mapped into this package by pyproject.toml, so the same lookup works from a checkout, an editable
install and a wheel.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path


def resource_dir(name: str) -> Path:
    """The folder of a shipped resource package ("launchers", "templates" or "trainer")."""
    return Path(str(resources.files(f"nodectl.resources.{name}")))
