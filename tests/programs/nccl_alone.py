"""NCCL (written for GPUs, not yet run on one): rank 0 works alone as in rank0_alone.py; rank 1's collective
times out in NCCL's watchdog, which dumps, tells rank 0's to dump through the store, and aborts rank 1.

Started by tests/repo/test_why_hung.py."""

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from failures import hang

folder, rank = sys.argv[1], int(os.environ["RANK"])
torch.cuda.set_device(rank)
hang.record(folder)
dist.init_process_group("nccl", timeout=timedelta(seconds=10), device_id=torch.device("cuda", rank))
hang.arm(folder, rank, 2)
x = torch.ones(1, device="cuda")
dist.all_reduce(x)  # both ranks finish this one
torch.cuda.synchronize()
if rank == 0:
    time.sleep(60)  # works alone
dist.all_reduce(x)  # rank 1 waits here
torch.cuda.synchronize()
