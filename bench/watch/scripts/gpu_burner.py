"""Another user's job on the same GPU: bf16 matrix products in a loop until killed (bench/watch/gpu_straggler.sh)."""
import torch

a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
while True:
    for _ in range(20):
        c = a @ b
    torch.cuda.synchronize()
