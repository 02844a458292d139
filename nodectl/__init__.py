"""nodectl: multi-node PyTorch training over plain SSH."""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("nodectl")
except PackageNotFoundError:  # running from a checkout that was not installed
    __version__ = "0.0.0+checkout"
