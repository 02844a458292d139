"""Rank 3 skips one all_reduce and sleeps: the others wait in it (the verdict tests
expect the sleep at line 14)."""
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, tensor = dist.get_rank(), torch.ones(4)
for step in range(3):
    dist.all_reduce(tensor)
print("hung from here", flush=True)
if rank == 3:
    time.sleep(600)   # rank 3 sleeps here
dist.all_reduce(tensor)
