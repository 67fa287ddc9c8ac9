"""Tensor parallel at world size 1 through the trainer's own functions, on the device this machine has (NCCL
on a GPU, gloo on a CPU): apply_tp's plan, fused AdamW over the DTensors, loss parallel, torch's clipping,
the checks and the skip on the device. 8 steps on one batch; prints whether every parameter is a DTensor
and the first and last loss. Run by torchrun with one process, examples/gpt on PYTHONPATH."""

from types import SimpleNamespace

import parallel
import torch
import torch.distributed as dist
from failures import guards
from model import GPT, GPTConfig, optimizer_groups
from parallel.apply import materialise
from parallel.dtensors import local
from parallel.tensor_parallel import apply_tp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import loss_parallel

cuda = torch.cuda.is_available()
device = torch.device("cuda", 0) if cuda else torch.device("cpu")
backend = "nccl" if cuda else "gloo"
dist.init_process_group(backend)
mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("tp",))
with torch.device("meta"):
    model = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64))
apply_tp(model, mesh)
materialise(model, device, seed=0)
optimizer = parallel.make_optimizer(optimizer_groups(model, 0.1), SimpleNamespace(zero=False), mesh, device)
batch = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0)).to(device)
losses = []
for _ in range(8):
    for group in optimizer.param_groups:
        group["lr"] = 3e-3
    with loss_parallel():
        _, loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
    norm = parallel.clip_grad_norm_(SimpleNamespace(module=model), 1.0)
    verdict = guards.verdict(local(loss.detach()), norm, False)
    optimizer.found_inf = guards.skip(verdict)
    with implicit_replication():
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    losses.append(verdict[0])
every = all(isinstance(p, DTensor) for p in model.parameters())
first, last = losses[0].item(), losses[-1].item()
print(f"tp 1 on {backend}: every parameter a DTensor {every}, fused AdamW, loss {first:.4f} -> {last:.4f}")
dist.destroy_process_group()
