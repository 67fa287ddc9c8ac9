"""memory.MemoryMeter on two FSDP2 processes: each counts its own shards, printed as one JSON line per
rank (one write per line: both ranks print into the same pipe, unbuffered in CI).

Started by tests/gpt/test_gpt_memory.py."""

import json
import os
import sys

import torch
import torch.distributed as dist
from observability.memory import MemoryMeter
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
for layer in model:
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters())
meter = MemoryMeter(model, optimizer)
model(torch.randn(4, 8)).sum().backward()
optimizer.step()
optimizer.zero_grad(set_to_none=True)  # as the trainer does: the gradients were counted at the step
# one write per line: both ranks print into the same pipe, unbuffered in CI
sys.stdout.write("MEMORY " + json.dumps(meter.report(torch.device("cpu"))) + "\n")
sys.stdout.flush()
dist.destroy_process_group()
os._exit(0)  # as examples/gpt/train.py does: DTensor's caches keep the group's threads alive
