"""Helpers for launch tests: a small torchrun project, and finding a run's processes by their environment."""
from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import psutil

SCRIPT = '''\
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
total = torch.tensor([rank + 1.0]); dist.all_reduce(total)
print(f"rank={rank} world={dist.get_world_size()} node={os.environ['NODECTL_NODE_RANK']} sum={total.item():g}",
      flush=True)
print("ARGS=" + repr(sys.argv[1:]), flush=True)
restart = int(os.environ.get("NODECTL_ATTEMPT", "0"))
if os.environ.get("FAIL_RANK") == str(rank) and restart < int(os.environ.get("FAIL_TIMES", "1000")):
    time.sleep(float(os.environ.get("FAIL_AFTER", "1")))
    print("rank is failing on purpose", flush=True)
    sys.exit(7)
time.sleep(float(os.environ.get("SLEEP", "0.2")))
dist.barrier()
dist.destroy_process_group()
'''


# A rank that imports torch, says it is in, all-reduces (gloo) for SECONDS_TO_RUN seconds and ends: the watch's
# tests and bench/watch/watch.py.
TIMED_ALL_REDUCE = """\
import os, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
print("in", os.environ["RANK"], flush=True)
# the ranks leave together: each step all-reduces whether any rank's time is up (one rank leaving on its own
# clock would meet the others' all-reduce with its barrier and hang them all)
done, until = torch.zeros(1), time.time() + float(os.environ["SECONDS_TO_RUN"])
while True:
    done.fill_(float(time.time() >= until))
    dist.all_reduce(done, op=dist.ReduceOp.MAX)
    if done.item():
        break
    time.sleep(0.1)
dist.destroy_process_group()
print("done", os.environ["RANK"], flush=True)
"""


def make_project(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.py").write_text(SCRIPT)
    (folder / ".gitignore").write_text("data/\n")
    (folder / "data").mkdir(exist_ok=True)
    (folder / "data" / "big.bin").write_bytes(b"x" * 1024)
    return folder


def run_processes(run_id: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("NODECTL_RUN_ID") == run_id and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def wait_for(predicate, timeout: float = 60, interval: float = 0.2):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("condition not met in time")


def latest_run_id(project: Path) -> str:
    return sorted(p.name for p in (project / "runs").iterdir() if p.name[0].isdigit())[-1]


def kill_leftovers(run_id: str) -> None:
    for proc in run_processes(run_id):
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


# A ProxyCommand: relays its stdin and stdout to HOST PORT (what `ssh -W` does through a bastion).
_RELAY = """\
import os, socket, sys, threading
peer = socket.create_connection((sys.argv[1], int(sys.argv[2])))


def upstream():
    while data := os.read(0, 65536):
        peer.sendall(data)
    peer.shutdown(socket.SHUT_WR)


threading.Thread(target=upstream, daemon=True).start()
while data := peer.recv(65536):
    os.write(1, data)
"""


def via_proxycommand(cluster, target, folder: Path, alias: str = "viacmd") -> str:
    """The cluster's ~/.ssh/config sends `alias` to `target` only through a relay ProxyCommand: its HostName,
    192.0.2.1 (TEST-NET), reaches nothing directly; the node's host key is trusted under that name."""
    relay = folder / "relay.py"
    relay.write_text(_RELAY)
    (cluster.home / ".ssh" / "config").write_text(
        f"Host {alias}\n  HostName 192.0.2.1\n  Port {target.port}\n  User root\n  IdentityFile {cluster.identity}\n"
        f"  ProxyCommand {sys.executable} {relay} {target.address} {target.port}\n")
    key = " ".join(cluster.known_hosts_lines()[0].split()[1:])
    with open(cluster.home / ".ssh" / "known_hosts", "a") as known:
        known.write(f"[192.0.2.1]:{target.port} {key}\n")
    return alias
