"""torchrun's agent on a node, as `python -m torch.distributed.run ARGS...` starts it, with one difference: Python's
cyclic garbage collector is off while torch is imported, and what the import made is then frozen out of the
collector's later passes (gc.freeze) before it is turned back on. The agent is a long-lived process holding the
whole of torch's module graph, a few hundred thousand objects, which each full pass of the collector walked again
for the run's whole life: on the CPU machine, 1.28 s of the agent's own CPU against 1.45 s over a two-rank gloo run
of 8 s (0.88x, medians of six, A B B A: `bench/launch/agent_start.py --rounds 3`, 2026-12-07). launch.sh runs
`python "$RUN_DIR/lib/elastic_agent.py" ARGS...`. Standard library only, until torch's own code."""
import gc
import os
import sys

# `python -m` puts the working folder (the run's code/) first on the path, a script its own folder (lib/): as -m does
sys.path[0] = os.getcwd()
gc.disable()
try:
    from torch.distributed.run import main
finally:
    gc.freeze()
    gc.enable()

if __name__ == "__main__":
    main()
