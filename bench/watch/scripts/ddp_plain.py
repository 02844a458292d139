"""A plain PyTorch DDP loop, written for no tool: `torchrun ... ddp_plain.py STEPS [WIDTH [PAUSE]]`. Rank 0 prints
one line per 10 steps with the wall time, which is what a bench reads its throughput from. PAUSE (seconds, default 0)
is slept each step, as a GPU job's host thread waits on its device: its ranks then leave the CPUs mostly idle."""
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
width = int(sys.argv[2]) if len(sys.argv) > 2 else 512
pause = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                                                    torch.nn.Linear(width, width), torch.nn.ReLU(),
                                                    torch.nn.Linear(width, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
data = torch.randn(64, width, generator=torch.Generator().manual_seed(rank))
target = data.sum(dim=1, keepdim=True)
for step in range(1, steps + 1):
    loss = torch.nn.functional.mse_loss(model(data), target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if pause:
        time.sleep(pause)
    if rank == 0 and step % 10 == 0:
        print(f"step {step} loss {loss.item():.4f} time {time.time():.3f}", flush=True)
dist.destroy_process_group()
