"""Ports and routes: a free port, a listener for preflight's reachability test, a connection, the route to an address."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from hostsfile import hosts_line
from ports import is_free, quiet_port


def cmd_port(args: list, request: dict) -> dict:
    """Whether a TCP port is free here, and a free one if not (launchers/ports.py: outside the ephemeral range,
    where no outgoing connection takes it before torchrun listens)."""
    port = int(args[0])
    if port == 0:
        return {"port": quiet_port(), "free": True, "asked": 0}
    if is_free(port):
        return {"port": port, "free": True, "asked": port}
    return {"port": quiet_port(), "free": False, "asked": port}


# The listener `listen` starts: a process of its own that accepts and closes connections on the sockets it was
# handed (their fds after its time and the count it expects, 0 for none), until its time is up or it has accepted
# that many. Standard library only: 15 nodes' listeners started at once cost their interpreters' start, no more.
# Its "_serve" argument is what `unlisten` checks before it signals a pid.
LISTENER = ("import selectors,socket,sys,time\n"
            "end,expect,accepted=time.time()+float(sys.argv[2]),int(sys.argv[3]),0\n"
            "chosen=selectors.DefaultSelector()\n"
            "for fd in sys.argv[4:]:\n"
            "    server=socket.socket(fileno=int(fd));server.setblocking(False)\n"
            "    chosen.register(server,selectors.EVENT_READ)\n"
            "while time.time()<end and not(expect and accepted>=expect):\n"
            "    for key,_ in chosen.select(timeout=0.2):\n"
            "        try:\n"
            "            conn,_=key.fileobj.accept();conn.close();accepted+=1\n"
            "        except OSError:\n"
            "            pass\n")


def cmd_listen(args: list, request: dict) -> dict:
    """Listen for a while in a detached process (preflight's reachability tests); returns its pid. On PORT (the
    master port, 0 for none) and, with request {"ephemeral": true}, on a port the kernel picks from its ephemeral
    range, as gloo and NCCL do for the connections between ranks: answered as `ephemeral`, with the range. With
    {"expect": N} the listener ends once it has accepted N connections (no `unlisten` needed), or at its time."""
    port, seconds = int(args[0]), float(args[1])
    sockets = []
    try:
        for wanted in ([port] if port else []) + ([0] if request.get("ephemeral") else []):
            server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(server)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                server.bind(("", wanted))
            except OSError:
                return {"error": f"cannot listen on port {wanted}"}
            server.listen(128)
        if not sockets:
            return {"error": "no port to listen on"}
        fds = [str(server.fileno()) for server in sockets]
        expect = int(request.get("expect") or 0)
        proc = subprocess.Popen([sys.executable, "-S", "-c", LISTENER, "_serve", str(seconds), str(expect), *fds],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, pass_fds=[server.fileno() for server in sockets])
        answer = {"pid": proc.pid, "port": port}
        if request.get("ephemeral"):
            answer["ephemeral"] = sockets[-1].getsockname()[1]
            answer["ephemeral_range"] = _ephemeral_range()
        return answer
    finally:
        for server in sockets:   # the listener holds its own copies
            server.close()


def _ephemeral_range() -> list | None:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="utf-8") as handle:
            low, high = (int(word) for word in handle.read().split()[:2])
        return [low, high]
    except (OSError, ValueError):
        return None


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
    ports = request.get("peer_ports")
    if isinstance(ports, dict) and ports:
        answer["peer_reach"] = _connect_all({str(a): int(p) for a, p in list(ports.items())[:4096]},
                                            float(request.get("timeout", 5)))
    name = request.get("resolve")
    if isinstance(name, str) and name:
        answer["resolved"] = _addresses(name)
        answer["resolved_line"] = hosts_line(name)
        answer["own"] = _own_addresses()
    return answer


def _own_addresses() -> list:
    """Every address of this node's interfaces (`ip -o addr`), without their prefix lengths."""
    try:
        proc = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    found = []
    for line in proc.stdout.splitlines():
        words = line.split()
        for family in ("inet", "inet6"):
            if family in words[:-1]:
                found.append(words[words.index(family) + 1].split("/")[0])
    return found


def _connect_all(targets: dict, timeout: float) -> dict:
    """A TCP connection to each address:port at once (one thread each, at most 64 at a time): {address: answer}."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(64, len(targets))) as pool:
        futures = {addr: pool.submit(_connect, addr, port, timeout) for addr, port in targets.items()}
    return {addr: future.result() for addr, future in futures.items()}


def _addresses(name: str) -> list | dict:
    """The addresses this node's resolver gives a name, in its order, or {"error"}."""
    try:
        return list(dict.fromkeys(info[4][0] for info in socket.getaddrinfo(name, None)))
    except (OSError, UnicodeError) as exc:
        return {"error": f"{exc.__class__.__name__}: {exc}"}



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
