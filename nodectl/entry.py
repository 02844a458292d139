"""The `nodectl` program's first lines. Loading the tool (click, rich, paramiko, the commands) takes a second or
two on a busy machine; a Ctrl-C or SIGTERM in that time ends it quietly with 130, as one a moment later does,
instead of a KeyboardInterrupt traceback from deep inside an import. Nothing has been started yet, so there is
nothing to stop. The command's own handlers replace these once it is loaded (nodectl/errors.py)."""
from __future__ import annotations

import os
import signal
import sys

EXIT_INTERRUPTED = 130


def _while_loading(signum, frame) -> None:
    sys.stderr.write("interrupted\n")
    sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)


def main() -> None:
    signal.signal(signal.SIGINT, _while_loading)
    signal.signal(signal.SIGTERM, _while_loading)
    from nodectl.cli import run

    run()


if __name__ == "__main__":
    main()
