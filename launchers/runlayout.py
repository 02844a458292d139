"""A run folder's layout on a node, `<workdir>/runs/<run id>[/<node>]/`: one module every side imports (runctl, in
whose artifact it travels; the ranks' helpers in lib/, beside which it is synced; nodectl on the controller, as
`nodectl.resources.launchers.runlayout`), so a file's name is written once. Paths are relative to the run folder.
Standard library only; imports nothing.
"""
from __future__ import annotations

# the folders a run folder holds; those of one attempt are archived when the run is resumed or restarted
FOLDERS = ("code", "lib", "logs", "state", "ranks", "heartbeat", "stacks", "output", "flight", "timing", "metrics",
           "torchelastic")
PER_ATTEMPT = ("logs", "state", "ranks", "heartbeat", "stacks", "flight", "timing")
# What the ranks write, the only folders a container's ranks get writable (the run folder is read-only there);
# state/, which the host acts on (what `stop` did, launch.sh's pid and exit, the cgroup), is not in it: the
# container sees an empty read-only folder in its place.
RANK_WRITABLE = ("code", "logs", "ranks", "heartbeat", "stacks", "output", "flight", "timing", "metrics",
                 "torchelastic")
HIDDEN = ("state",)

NODE_JSON = "node.json"                 # what the node's share of the run is (run id, node rank, ranks)
SECRET_FILES = ("env.sh", "launch.sh")  # hold the real secrets: never packed, never shown

STARTED = "state/started"               # when runctl started launch.sh
PGID = "state/pgid"                     # launch.sh's pid (a run was started here when this exists)
BOOT = "state/boot"                     # the kernel's boot id at the start
CGROUP = "state/cgroup"                 # the run's cgroup, where the login could make one
STOPPED = "state/stopped"               # what `stop` did
LAUNCHER_EXIT = "state/launcher.exit"   # torchrun's exit code and time, written by launch.sh's trap
UPLOAD = "state/upload.json"            # the bucket uploader's record
HARDWARE = "state/hardware.json"        # the hardware counters when the run started (runctl/hardware.py)
BORROWED = "state/borrowed.json"        # output/ files another node's share brought for a resume (fill, or a pull
                                        # of node 0's): {path: [size, mtime_ns]}, not this node's to upload
LAUNCHER_LOG = "logs/launcher.log"      # launch.sh's and torchrun's own output

# a log line longer than this is cut with a marker: by the node when it sends logs (poll, tail), and by the
# controller in a followed stream (memory per rank stays bounded)
LINE_MAX = 16 * 1024


def rank_log(rank: int) -> str:
    return f"logs/rank{rank}.log"


def rank_exit(rank: int) -> str:
    """Written by the rank's wrapper (lib/rankexec.py), inside the container where there is one."""
    return f"ranks/rank{rank}.exit"


def rank_pid(rank: int) -> str:
    return f"ranks/rank{rank}.pid"


def rank_wrapper(rank: int) -> str:
    """The pid of the rank's wrapper (lib/rankexec.py), the process that writes its exit record."""
    return f"ranks/rank{rank}.wrapper"


def heartbeat(rank: int) -> str:
    return f"heartbeat/rank{rank}.json"


def rank_stack(rank) -> str:
    """Where a rank's faulthandler writes its stacks on SIGUSR1."""
    return f"stacks/rank{rank}.txt"


def rank_metrics(rank) -> str:
    """What nodectl_metrics appends, a JSON line per report."""
    return f"metrics/rank{rank}.jsonl"


FLIGHT = "flight"                       # the rank listener's answers and the flight recorders' dumps


def rank_request(rank) -> str:
    """The FIFO on which a rank's listener (lib/sitecustomize.py) takes `diagnose`'s requests."""
    return f"{FLIGHT}/rank{rank}.request"


def rank_pace(rank) -> str:
    """The rank's latest collectives as its flight recorder holds them (lib/flightpace.py): when it reached each one
    and, on NCCL, how long each took; written by runctl from the rank's worker server when asked, at most every few
    seconds, or by the rank's pace thread where its torch has no such server."""
    return f"{FLIGHT}/rank{rank}.pace.json"


def rank_socket(rank) -> str:
    """The unix socket of torch's worker server in the rank, which serves its flight recorder to runctl for the
    pace (lib/flightpace.py); named in the pace file while it is there."""
    return f"{FLIGHT}/rank{rank}.sock"


def rank_answer(rank) -> str:
    """Where the listener writes its answer to one request (atomically, with the request's id)."""
    return f"{FLIGHT}/rank{rank}.answer.json"
