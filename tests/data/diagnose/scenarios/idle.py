"""Every rank writes a heartbeat, then all wait outside torch.distributed (here: a sleep standing for a lock)."""
import time

import torch
import torch.distributed as dist
from nodectl_metrics import report

dist.init_process_group("gloo")
tensor = torch.ones(4)
for step in range(3):
    dist.all_reduce(tensor)
    report(step=step)
print("hung from here", flush=True)
time.sleep(600)   # every rank waits here
