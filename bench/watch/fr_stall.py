"""What reading torch's flight recorder costs a training loop, by the way it is read (issue 51). Run with
`torchrun --nproc-per-node 2 bench/watch/fr_stall.py` on 2 GPUs (NCCL, TORCH_NCCL_TRACE_BUFFER_SIZE=2000 and
TORCH_NCCL_ENABLE_TIMING=1 as nodectl sets them, FR_FOLDER a folder for the sockets). A DDP loop of 64 ms steps runs through PHASE-second phases in
turn, every mode CYCLES times:
  none      nothing reads the recorder;
  server    another process asks each rank's worker server (torch's C++ thread) for the JSON dump every EVERY s;
  handlers  the same process asks the server only its handler list (the connection, no dump);
  inproc    each rank's own thread calls torch's Python dump (`_dump_nccl_trace`) every EVERY s, as nodectl did.
Per mode: mean, median, p99 and max step time, and the mean against `none`'s.
DEVICE=cpu: the same on gloo and the CPU (a smaller loop: LAYERS=4 WIDTH=512 ROWS=2048), gloo's recorder
(TORCH_FR_BUFFER_SIZE), its handler `fr_trace_json` and Python dump `_dump_fr_trace`."""
from __future__ import annotations

import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "launchers"))
import flightpace  # noqa: E402

PHASE, CYCLES, EVERY = float(os.environ.get("PHASE", 20)), int(os.environ.get("CYCLES", 2)), float(os.environ.get("EVERY", 1))
MODES = ("none", "server", "handlers", "inproc")
CPU = os.environ.get("DEVICE") == "cpu"
HANDLER = "fr_trace_json" if CPU else "dump_nccl_trace_json"
LAYERS, WIDTH, ROWS = (int(os.environ.get(k, d)) for k, d in (("LAYERS", 4 if CPU else 24), ("WIDTH", 512 if CPU else 4096),
                                                              ("ROWS", 2048 if CPU else 16384)))


def mode_at(start: float, now: float) -> str | None:
    index = int((now - start) // PHASE)
    return MODES[index % len(MODES)] if index < CYCLES * len(MODES) else None


def fetcher(folder: str, world: int, start: float) -> None:
    """The reader process: as runctl does, but every EVERY s."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    while (mode := mode_at(start, time.time())) is not None:
        for rank in range(world):
            try:
                if mode == "server":
                    flightpace.pace_rows(flightpace.fetch(fd, f"rank{rank}.sock", HANDLER), not CPU)
                elif mode == "handlers":
                    flightpace.handler_names(fd, f"rank{rank}.sock")
            except OSError:
                pass
        time.sleep(EVERY)


def main() -> None:
    if sys.argv[1:2] == ["fetch"]:
        return fetcher(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    dist.init_process_group("gloo" if CPU else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device, dtype = ("cpu", torch.float32) if CPU else ("cuda", torch.bfloat16)
    if not CPU:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    folder = os.environ.get("FR_FOLDER") or tempfile.gettempdir()
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    name = f"rank{rank}.sock"
    try:
        os.unlink(name, dir_fd=fd)
    except OSError:
        pass
    server = torch._C._distributed_c10d._WorkerServer(flightpace.socket_address(fd, name))  # noqa: F841
    layers = [torch.nn.Linear(WIDTH, WIDTH, dtype=dtype, device=device) for _ in range(LAYERS)]
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers), bucket_cap_mb=25)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    batch = torch.randn(ROWS, WIDTH, dtype=dtype, device=device)
    for _ in range(20):   # warm-up
        model(batch).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    if not CPU:
        torch.cuda.synchronize()
    start = torch.tensor([time.time() + 3.0], dtype=torch.float64, device=device)
    dist.broadcast(start, 0)
    start = float(start.item())
    if rank == 0:
        subprocess.Popen([sys.executable, __file__, "fetch", folder, str(world), str(start)])

    def inproc() -> None:
        while (mode := mode_at(start, time.time())) is not None:
            if mode == "inproc":
                dump = torch._C._distributed_c10d._dump_fr_trace if CPU else torch._C._distributed_c10d._dump_nccl_trace
                pickle.loads(dump(True, False, False))
            time.sleep(EVERY - time.time() % EVERY)
    threading.Thread(target=inproc, daemon=True).start()
    while time.time() < start:
        time.sleep(0.01)
    steps: dict = {m: [] for m in MODES}
    last = time.time()
    while True:
        model(batch).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        loss = model.module[0].weight[0, 0].item()   # the host waits for the step, as a trainer's logging does
        now = time.time()
        mode = mode_at(start, now)
        if mode is None:
            break
        if mode == mode_at(start, last) and (now - start) % PHASE > 2:
            steps[mode].append(now - last)
        last = now
    del loss
    if rank == 0:
        base = statistics.mean(steps["none"])
        for mode in MODES:
            times = sorted(steps[mode])
            print(json.dumps({"mode": mode, "steps": len(times), "mean_ms": round(statistics.mean(times) * 1e3, 2),
                              "median_ms": round(statistics.median(times) * 1e3, 2),
                              "p99_ms": round(times[int(len(times) * 0.99)] * 1e3, 2),
                              "max_ms": round(times[-1] * 1e3, 2),
                              "throughput_vs_none": round(base / statistics.mean(times), 4)}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
