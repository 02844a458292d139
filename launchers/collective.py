#!/usr/bin/env python3
"""Preflight's collective test, started by torchrun on every selected node and rank (nodectl's launch path).

All-reduce (sum, float32, like nccl-tests' all_reduce_perf) from the smallest to the largest size: checks the
result on every rank and measures bus bandwidth, busbw = algbw x 2(n-1)/n. Every rank reports whether its
result was right; rank 0 prints one line `NODECTL_COLLECTIVE {json}`. Imports nothing from nodectl.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist


def measure(tensor: torch.Tensor, iters: int, sync) -> float:
    for _ in range(2):
        dist.all_reduce(tensor)
    sync()
    started = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor)
    sync()
    return (time.perf_counter() - started) / iters


def _address_toward(host: str, port: int) -> str:
    """This machine's address on the route toward `host` (no packet is sent: a UDP socket's connect only routes)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]


def check_peers(deadline: float) -> None:
    """Before the process group: every rank listens on an ephemeral port, publishes it in torchrun's store, and
    opens a connection to every rank of the other nodes. Gloo and NCCL connect rank to rank on such ports, and
    a firewall that lets only SSH and the master port in makes gloo fail with "Connect timeout [none]" after
    its whole timeout, naming nobody. Here the rank that cannot connect says to whom, and exits 1.
    Only where torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE): otherwise the store appears
    only with the process group."""
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if world == 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    master, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.PrefixStore("nodectl-peers/", dist.TCPStore(master, port, world, False,
                                                            timeout=timedelta(seconds=deadline)))
    listener = socket.socket()
    listener.bind((_address_toward(master, port), 0))
    listener.listen(world)

    def accept() -> None:
        while True:
            try:
                listener.accept()[0].close()
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    host, bound = listener.getsockname()
    node = os.environ.get("NODECTL_NODE_RANK", os.environ.get("GROUP_RANK", "?"))
    store.set(str(rank), json.dumps({"addr": host, "port": bound, "node": node, "host": socket.gethostname()}))
    peers = {j: json.loads(store.get(str(j))) for j in range(world) if j != rank}

    def connect(item) -> str | None:
        j, peer = item
        try:
            socket.create_connection((peer["addr"], peer["port"]), timeout=min(deadline, 20.0)).close()
            return None
        except OSError as exc:
            reason = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
            return (f"rank {rank} (node rank {node}) cannot connect to rank {j} (node rank {peer['node']}, host "
                    f"{peer['host']}) at {peer['addr']}:{peer['port']}: {reason}")

    others = [(j, p) for j, p in peers.items() if p["node"] != node]
    with ThreadPoolExecutor(max_workers=max(1, min(32, len(others)))) as pool:
        failures = [f for f in pool.map(connect, others) if f]
    store.add("checked", 1)  # keep listening until every rank has tried its connections
    waited = time.monotonic() + deadline
    while int(store.add("checked", 0)) < world and time.monotonic() < waited and not failures:
        time.sleep(0.05)
    listener.close()
    if failures:
        for line in failures[:8]:
            print(f"NODECTL_PEER_UNREACHABLE {line}", file=sys.stderr, flush=True)
        print("rank-to-rank connections are blocked while the master port is open: open the ephemeral ports "
              "between the nodes (NODE_SETUP.md, section 4)", file=sys.stderr, flush=True)
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--min-bytes", type=int, default=1 << 20)
    parser.add_argument("--max-bytes", type=int, default=1 << 30)
    parser.add_argument("--budget-s", type=float, default=1.0, help="rough time per size")
    parser.add_argument("--deadline-s", type=float, default=120.0,
                        help="longest wait for any peer or collective (torch's defaults: 10 min NCCL, 30 min gloo)")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available() and os.environ.get("NODECTL_DEVICE") != "cpu"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    check_peers(args.deadline_s)
    dist.init_process_group("nccl" if on_gpu else "gloo", device_id=device if on_gpu else None,
                            timeout=timedelta(seconds=args.deadline_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    results, size = [], args.min_bytes
    while size <= args.max_bytes:
        count = size // 4
        tensor = torch.full((count,), float(rank + 1), device=device)
        dist.all_reduce(tensor)
        expected = world * (world + 1) / 2
        ok = torch.tensor([1.0 if bool((tensor == expected).all()) else 0.0], device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        probe = torch.tensor([measure(tensor, 1, sync)], device=device)
        dist.all_reduce(probe, op=dist.ReduceOp.MAX)  # every rank must run the same number of all-reduces
        iters = max(3, min(200, int(args.budget_s / max(probe.item(), 1e-6))))
        seconds = torch.tensor([measure(tensor, iters, sync)], device=device)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        algbw = size / seconds.item() / 1e9
        results.append({"bytes": size, "ok": bool(ok.item()), "time_us": seconds.item() * 1e6, "iters": iters,
                        "algbw_gbs": algbw, "busbw_gbs": algbw * 2 * (world - 1) / world})
        size *= 2
    if rank == 0:
        print("NODECTL_COLLECTIVE " + json.dumps({"world": world, "backend": dist.get_backend(), "sizes": results}),
              flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
