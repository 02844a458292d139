"""`python -m runctl COMMAND ARGS...` (with launchers/ on the path); on a node, the artifact's own __main__."""
from runctl.dispatch import main

main()
