"""Rank 1 spins in a Python loop after step 1 (the seed case: one process at 104% CPU, the others waiting)."""
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, tensor = dist.get_rank(), torch.ones(4)
for step in range(100):
    dist.all_reduce(tensor)
    if step == 1:
        print("hung from here", flush=True)
    if rank == 1 and step == 1:
        spins = 0
        while spins >= 0:   # rank 1 spins here
            spins += 1
