"""NCCL (GPUs only): rank 0 works alone past the 10 s timeout while rank 1 waits in an all-reduce, and
rank 1's wait ends with NCCL's timeout error.

Started by tests/repo/test_gpu.py."""

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", timeout=timedelta(seconds=10), device_id=torch.device("cuda", rank))
x = torch.ones(1, device="cuda")
dist.all_reduce(x)  # one collective both ranks finish: the recorder's first entry
torch.cuda.synchronize()
if rank == 0:
    time.sleep(60)  # works alone (the rank0_alone pitfall), past the timeout
dist.all_reduce(x)  # rank 1 waits here for rank 0
torch.cuda.synchronize()
