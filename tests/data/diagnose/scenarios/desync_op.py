"""Rank 2 calls broadcast where the others call all_reduce: the same sequence number, different collectives."""
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, tensor = dist.get_rank(), torch.ones(4)
dist.all_reduce(tensor)
print("hung from here", flush=True)
if rank == 2:
    dist.broadcast(tensor, src=0)
else:
    dist.all_reduce(tensor)
