"""The ranks disagree on a tensor's size in all_gather: rank 2 sends 2 float64 where the others send 4 float32.
The bytes agree, so gloo goes on (a size mismatch in bytes aborts gloo at once); the gathered sizes then differ
and the ranks run different numbers of steps: the others wait for rank 2's all_reduce that never comes."""
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
dist.all_reduce(torch.ones(4))
mine = torch.ones(2, dtype=torch.float64) if rank == 2 else torch.ones(4)
gathered = [torch.zeros_like(mine) for _ in range(world)]
dist.all_gather(gathered, mine)
print("hung from here", flush=True)
for _ in range(sum(t.numel() for t in gathered) // 4):
    dist.all_reduce(torch.ones(4))
time.sleep(600)
