"""A healthy run with long steps (3 s of work between collectives) and a heartbeat per step."""
import time

import torch
import torch.distributed as dist
from nodectl_metrics import report

dist.init_process_group("gloo")
tensor = torch.ones(4)
for step in range(int(__import__("os").environ.get("STEPS", "200"))):
    if step == 1:
        print("hung from here", flush=True)   # not hung: the marker the capture waits for
    time.sleep(3)
    dist.all_reduce(tensor)
    report(step=step)
print("done", flush=True)
