"""Ports and routes: a free port, a listener for preflight's reachability test, a connection, the route to an address."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time


def cmd_port(args: list, request: dict) -> dict:
    """Whether a TCP port is free here, and a free one if not."""
    port = int(args[0])
    if port == 0:
        with socket.socket() as probe:
            probe.bind(("", 0))
            return {"port": probe.getsockname()[1], "free": True, "asked": 0}
    with socket.socket() as probe:
        # torch's TCPStore binds with SO_REUSEADDR, so sockets in TIME_WAIT from a run or a reachability test that
        # just ended do not stop it; judge the port the same way.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
            return {"port": port, "free": True, "asked": port}
        except OSError:
            pass
    with socket.socket() as probe:
        probe.bind(("", 0))
        return {"port": probe.getsockname()[1], "free": False, "asked": port}


# Where `runctl` imports from: the artifact (a zip) on a node, launchers/ in a checkout. The listener runs from the
# same place in a process of its own.
IMPORT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVE = "import sys;sys.path.insert(0,sys.argv[1]);sys.argv=sys.argv[1:];from runctl.dispatch import main;main()"


def cmd_listen(args: list, request: dict) -> dict:
    """Listen on a port for a while in a detached process (preflight's reachability test); returns its pid."""
    port, seconds = int(args[0]), float(args[1])
    proc = subprocess.Popen([sys.executable, "-S", "-c", SERVE, IMPORT_ROOT, "_serve", str(port), str(seconds)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 5
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return {"pid": proc.pid, "port": port}
        except OSError:
            if proc.poll() is not None:
                return {"error": f"cannot listen on port {port}"}
            time.sleep(0.05)
    return {"error": f"listener on port {port} did not come up"}


def cmd_serve(args: list, request: dict) -> dict:
    port, deadline = int(args[0]), time.time() + float(args[1])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("", port))
        server.listen(128)
        server.settimeout(0.2)
        while time.time() < deadline:
            try:
                conn, _ = server.accept()
                conn.close()
            except OSError:
                pass
    return {}


def cmd_unlisten(args: list, request: dict) -> dict:
    pid = int(args[0])
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            if b"_serve" in handle.read():
                os.kill(pid, signal.SIGTERM)
    except OSError:
        pass
    return {}


def cmd_connect(args: list, request: dict) -> dict:
    return _connect(args[0], int(args[1]), float(request.get("timeout", 5)))


def _connect(host: str, port: int, timeout: float) -> dict:
    started = time.time()
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return {"ok": True, "ms": (time.time() - started) * 1000}
    except OSError as exc:
        return {"ok": False, "error": str(exc) or exc.__class__.__name__}


def cmd_route(args: list, request: dict) -> dict:
    """The interface this node sends to ADDR through (ip route get), or null where ip is missing; with `peers`
    (the other nodes' addresses), the interface toward each. With `connect` ({host, port}), a TCP connection to
    it first (`reach`): preflight asks both of every node in one call."""
    reach = request.get("connect")
    reached = _connect(str(reach["host"]), int(reach["port"]), float(request.get("timeout", 5))) \
        if isinstance(reach, dict) else None
    answer = _route(args[0])
    if reached is not None:
        answer["reach"] = reached
    peers = [str(p) for p in (request.get("peers") or [])][:4096]
    if peers:
        answer["peers"] = _routes(peers)
    return answer


ROUTE_TYPES = ("local", "unicast", "broadcast", "multicast", "anycast", "unreachable", "blackhole", "prohibit")


def _routes(peers: list) -> dict:
    """The interface toward each peer, from one `ip -batch` (one process, not one per peer: 16 nodes asked 240
    before); a peer named by host name is resolved here first, as the ranks will resolve it."""
    addresses = {}
    for peer in peers:
        try:
            addresses[peer] = socket.gethostbyname(peer)
        except (OSError, UnicodeError):
            addresses[peer] = None
    asked = sorted({a for a in addresses.values() if a})
    try:
        proc = subprocess.run(["ip", "-o", "-force", "-batch", "-"], input="".join(f"route get {a}\n" for a in asked),
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return {peer: None for peer in peers}
    found = {}
    for line in proc.stdout.splitlines():
        words = line.split()
        if words and words[0] in ROUTE_TYPES:
            words = words[1:]
        if words and "dev" in words:
            found[words[0]] = words[words.index("dev") + 1]
    return {peer: found.get(addresses[peer]) if addresses[peer] else None for peer in peers}


def _route(addr: str) -> dict:
    try:
        proc = subprocess.run(["ip", "route", "get", addr], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {"dev": None}
    words = proc.stdout.split()
    return {"dev": words[words.index("dev") + 1] if "dev" in words else None, "raw": proc.stdout.strip()}
