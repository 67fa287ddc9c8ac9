"""How the processes share the work, chosen by --parallel: one small function per strategy.

Each function takes the plain model and returns what the trainer runs forward and backward on. Read them
side by side: the delta from DDP is the lesson.
"""

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP


def ddp(model, args, device):
    """A full replica in every process; backward() averages the gradients over all of them."""
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if args.comm_hook:  # each gradient bucket travels in 16 bits and is cast back to float32
        model.register_comm_hook(None, getattr(default_hooks, f"{args.comm_hook}_compress_hook"))
    return model


def zero(model, args, device):
    """DDP as it is; the difference is the optimizer (make_optimizer): each process keeps the AdamW state
    of its share of the parameters only, updates that share, and broadcasts it to the others."""
    return ddp(model, args, device)


def fsdp(model, args, device):
    """Every parameter split in equal parts over the processes (FSDP2). Each block gathers its weights
    just before its forward and backward and drops them after; gradients are reduce-scattered, so each
    process keeps the gradient and AdamW state of its part alone. The tied embedding/output matrix
    belongs to no block: the root call shards it, once."""
    from torch.distributed.fsdp import fully_shard  # imported here: it costs every run a second or two

    raw = getattr(model, "_orig_mod", model)  # under torch.compile, shard the module it wraps
    for block in raw.blocks:
        fully_shard(block)
    fully_shard(raw)
    return model


STRATEGIES = {"ddp": ddp, "zero": zero, "fsdp": fsdp}
SHARDED_SNAPSHOTS = {"fsdp"}  # their snapshots are directories of shards (checkpoint.save_sharded)


def parallelize(model, args, device):
    """The model wrapped by the strategy of --parallel; unchanged in a single process."""
    if not dist.is_initialized():
        return model
    return STRATEGIES[args.parallel](model, args, device)


def data_parallel_layout(args, rank, world):
    """(this process's share, number of shares) of each global batch: every process has its own share
    under data parallelism; processes that split one model between them share one."""
    return rank, world


def make_optimizer(groups, args, device):
    """AdamW over the parameter groups; under --parallel zero, split over the processes by whole tensors.
    Built after parallelize(): FSDP replaces the parameters by their shards."""
    options = dict(lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    if args.parallel == "zero" and dist.is_initialized():
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, torch.optim.AdamW, **options)
    return torch.optim.AdamW(groups, **options)


def full_optimizer_state(optimizer):
    """The whole optimizer state_dict in process 0 (None in the others under --parallel zero, whose
    shares are first gathered there); a collective under zero."""
    if hasattr(optimizer, "consolidate_state_dict"):  # a ZeroRedundancyOptimizer
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if dist.get_rank() == 0 else None
    return optimizer.state_dict()


def gradient_sync(model, enabled):
    """A context for backward(): with enabled=False, gradients add up locally without communication
    (DDP's no_sync, FSDP's set_requires_gradient_sync); the last micro-batch's backward reduces them."""
    inner = getattr(model, "_orig_mod", model)
    if hasattr(inner, "set_requires_gradient_sync"):  # an FSDP module
        inner.set_requires_gradient_sync(enabled)
    elif isinstance(model, DDP) and not enabled:
        return model.no_sync()
    return nullcontext()


def full_parameters(model):
    """Every parameter whole, in every process: FSDP's shards (DTensors) are gathered; a collective."""
    return [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
