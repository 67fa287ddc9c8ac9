"""How the processes share the work, chosen by --parallel: one small function per strategy.

Each function takes the plain model and returns what the trainer runs forward and backward on. Read them
side by side: the delta from DDP is the lesson.
"""

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP


def ddp(model, args, device):
    """A full replica in every process; backward() averages the gradients over all of them."""
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if args.comm_hook:  # each gradient bucket travels in 16 bits and is cast back to float32
        model.register_comm_hook(None, getattr(default_hooks, f"{args.comm_hook}_compress_hook"))
    return model


STRATEGIES = {"ddp": ddp}


def parallelize(model, args, device):
    """The model wrapped by the strategy of --parallel; unchanged in a single process."""
    if not dist.is_initialized():
        return model
    return STRATEGIES[args.parallel](model, args, device)


def data_parallel_layout(args, rank, world):
    """(this process's share, number of shares) of each global batch: every process has its own share
    under data parallelism; processes that split one model between them share one."""
    return rank, world
