"""Import trainer modules the way nodes do (package `trainer`), from the repository checkout."""
import importlib
import sys

from support import REPO

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def trainer_module(name: str):
    return importlib.import_module(f"trainer.{name}")
