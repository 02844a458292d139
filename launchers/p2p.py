#!/usr/bin/env python3
"""Preflight's P2P test on one node: for every ordered GPU pair, torch's peer-access answer, a copy whose data
is checked, and its bandwidth. P2P can report "available" and still fail or corrupt data (ACS, IOMMU); only a
checked copy tells. Prints one JSON document. Sent over stdin; imports nothing from nodectl."""
from __future__ import annotations

import json
import time


def main() -> None:
    import torch

    count = torch.cuda.device_count()
    pairs = []
    if count >= 2:
        numel = (64 << 20) // 4
        for src in range(count):
            data = torch.randint(-2**31, 2**31 - 1, (numel,), dtype=torch.int32, device=f"cuda:{src}")
            expected = data.cpu()
            for dst in range(count):
                if src == dst:
                    continue
                entry = {"src": src, "dst": dst, "peer_access": torch.cuda.can_device_access_peer(src, dst)}
                try:
                    copy = data.to(f"cuda:{dst}")
                    torch.cuda.synchronize(src), torch.cuda.synchronize(dst)
                    entry["ok"] = bool(torch.equal(copy.cpu(), expected))
                    started = time.perf_counter()
                    for _ in range(5):
                        copy.copy_(data, non_blocking=True)
                    torch.cuda.synchronize(src), torch.cuda.synchronize(dst)
                    entry["gbps"] = 5 * numel * 4 / (time.perf_counter() - started) / 1e9
                except RuntimeError as exc:  # e.g. "CUDA error: invalid argument"
                    entry.update(ok=False, error=str(exc).splitlines()[0], gbps=0.0)
                pairs.append(entry)
    print(json.dumps({"gpus": count, "pairs": pairs}))


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:  # the check reports it; the probe of the rest goes on
        print(json.dumps({"error": f"{exc.__class__.__name__}: {exc}"}))
