"""Node-side helper for one run folder: prepare, start, poll, stop, stacks, logs, pack; one module per job.

nodectl ships this package to each node as one artifact (a zip with a __main__, built by nodectl/remote/agent.py:
the same bytes, so the same sha256, from every controller of one version), installs it once per version under
<workdir>/.nodectl/, checks its owner, mode and hash before every call, and calls it over SSH with argv and a JSON
document on stdin; it answers with one JSON document on stdout. Standard library only; imports nothing from
nodectl. A run's processes are the ones whose environment carries this run's NODECTL_RUN_ID and node rank:
torchrun starts each rank in a session of its own, so one process group is not enough, and a recorded pid or
group number is never trusted alone (after a reboot it may name another process). Signals go through a pidfd
after that proof, so `stop` gets all of the run's processes and nothing else.

    common      the run folder's files, the node-side trust rule, quiet subprocesses
    store       the content-addressed object store, receiving a tar stream, the workdir's identity
    runfolder   laying out a run folder, archiving an attempt
    processes   which processes are a run's (cgroup, process tree, environment markers), signalling them
    start       launch.sh detached, in its own session and cgroup
    watch       poll and tail: ranks' states, log text, a GPU sample, the uploader's record
    stop        SIGTERM, then SIGKILL after the grace period
    containers  the runtime checked, the run's container removed
    envs        locked environments (venvs) built and checked
    diagnose    stacks and CPU use of every rank
    collect     pack (collect), fill (node 0's outputs), pull (the bucket), cleanup
    net         ports, a listener, a connection, a route
    dispatch    the command line: name, request, answer
"""
import importlib

# Each call imports only what its command needs (dispatch.command); `runctl.<module>` still reaches any of them.
MODULES = ("collect", "common", "containers", "diagnose", "dispatch", "envs", "hardware", "net", "pace", "processes",
           "runfolder", "start", "stop", "store", "watch")


def __getattr__(name: str):
    if name in MODULES:
        return importlib.import_module(f"runctl.{name}")
    raise AttributeError(f"module 'runctl' has no attribute {name!r}")
