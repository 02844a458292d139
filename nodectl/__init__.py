"""nodectl: multi-node PyTorch training over plain SSH.

Importing the package itself loads nothing: `python -m nodectl` and the `nodectl` script import it before the
entry point (nodectl/entry.py) takes over Ctrl-C, and a Ctrl-C in that moment must find as little as possible
running (importlib.metadata alone took 0.3 s on a loaded machine). `__version__` is read when first asked for."""
from __future__ import annotations


def __getattr__(name: str):
    if name != "__version__":
        raise AttributeError(f"module 'nodectl' has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("nodectl")
    except PackageNotFoundError:  # running from a checkout that was not installed
        found = "0.0.0+checkout"
    globals()["__version__"] = found
    return found
