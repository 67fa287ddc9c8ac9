"""The processes: joining the group under torchrun, and a value from every process (all_ranks), the
one collective that the trainer, its snapshots and its metrics all use. Alone here so that every
family can import it without importing the trainer."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def setup_processes(timeout=600):
    """(rank, world size, device). Under torchrun: join the process group (NCCL on GPUs, else
    gloo); a process that waits longer than `timeout` seconds for the others, then or in any
    collective, fails."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        torch.backends.cuda.matmul.allow_tf32 = True  # float32 matmuls (--dtype fp32) on tensor cores
        torch.backends.cudnn.allow_tf32 = True
    else:
        device = torch.device("cpu")
    if "WORLD_SIZE" in os.environ:
        backend = "nccl" if device.type == "cuda" else "gloo"
        # device_id: NCCL connects at once, here, not at the first collective
        device_id = device if device.type == "cuda" else None
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout), device_id=device_id)
    return rank, world, device


def all_ranks(obj):
    """obj from every process, in rank order."""
    if not dist.is_initialized():
        return [obj]
    objs = [None] * dist.get_world_size()
    dist.all_gather_object(objs, obj)
    return objs
