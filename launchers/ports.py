"""A free TCP port that stays free: one below the kernel's ephemeral range. A port the kernel hands out for
`bind(0)` comes from that range, the same one it draws from for every outgoing connection (gloo's and NCCL's
between ranks, ssh, an upload); between the check and torchrun's listen, another connection can take it, and the
TCPStore fails with EADDRINUSE. Ports below the range are handed to nobody unasked. Shipped inside runctl's artifact;
the controller imports it (nodectl.resources.launchers.ports). Standard library only, Python 3.8+ syntax."""
from __future__ import annotations

import random
import socket

LOWEST = 20000        # above the well-known services a node may run (and torchrun's own 29500 is only a default)
EPHEMERAL = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_range(path: str = EPHEMERAL) -> tuple:
    """The kernel's range for ports it picks itself (Linux's default is 32768-60999)."""
    try:
        with open(path) as f:
            low, high = (int(v) for v in f.read().split()[:2])
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def is_free(port: int) -> bool:
    """Whether a listener could take `port` on every address, as torch's TCPStore binds (SO_REUSEADDR: sockets in
    TIME_WAIT from a run that just ended do not stop it)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


def quiet_port(tries: int = 200, chooser: random.Random = None) -> int:
    """A free port outside the ephemeral range: below it where the range leaves room, else above it; the kernel's
    own pick when every try is taken."""
    chooser = chooser or random.SystemRandom()
    low, high = ephemeral_range()
    spans = [(LOWEST, low - 1)] if low - 1 - LOWEST >= 1000 else []
    if high + 1 <= 65535 and 65535 - high - 1 >= 1000:
        spans.append((high + 1, 65535))
    for _ in range(tries if spans else 0):
        first, last = chooser.choice(spans)
        port = chooser.randint(first, last)
        if is_free(port):
            return port
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]
