"""Data parallel: FSDP2 (dp_shard, and HSDP's replicas), DDP (dp_replicate alone), and
AdamW, or under zero the ZeroRedundancyOptimizer over the replicas."""

import torch
from torch.nn.parallel import DistributedDataParallel as DDP


def apply_fsdp(model, mesh, param_dtype=None, reshard_after_forward=True):
    """FSDP2 over (dp_replicate, dp_shard): each block's parameters split over dp_shard, gathered
    just before its forward and backward, gradients reduce-scattered; with dp_replicate > 1, HSDP:
    the shards are replicated and their gradients all-reduced across replicas. Under bf16,
    parameters travel in bf16 (the norms upcast them), gradients are reduced in float32 and the
    float32 shards are the master copy. The tied embedding/head matrix belongs to no block: the
    root call shards it, once. A pipeline stage passes reshard_after_forward=False (torchtitan's
    policy under pp): each block stays gathered from its first micro-batch's forward to the step's
    last backward, one all-gather per block and step instead of one per micro-batch and pass."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # costs a second or two to import

    # the blocks' inputs are not cast: the residual stream
    # stays float32, as one process's under autocast
    policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    dp_mesh = mesh["dp_replicate", "dp_shard"]
    blocks = list(model.blocks.values())
    for block in blocks:
        # the last block stays gathered after forward: backward starts with it
        reshard = reshard_after_forward and block is not blocks[-1]
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)


def apply_ddp(module, mesh, device, comm_hook=None):
    """DDP over dp_replicate: a whole replica (or pipeline stage) per process; backward()
    averages the gradients over the replicas, optionally in 16 bits on the wire."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    group = mesh["dp_replicate"].get_group()
    ids = [device.index] if device.type == "cuda" else None
    # gradients are views into DDP's buckets: no copy
    # into them before each all-reduce, nor the memory
    module = DDP(module, device_ids=ids, process_group=group, gradient_as_bucket_view=True)
    if comm_hook:  # each gradient bucket travels in 16 bits and is cast back to float32
        module.register_comm_hook(group, getattr(default_hooks, f"{comm_hook}_compress_hook"))
    return module


def make_optimizer(groups, layout, mesh, device):
    """AdamW over the parameter groups, built after the model is split (FSDP and tp replace
    parameters); under zero, each replica keeps and updates the AdamW state of its share of the
    tensors only, then broadcasts the updated share."""
    # fused on every device: the GPU's kernel runs on the CPU too, so the tests run the GPU's path;
    # it also skips a step on the device (found_inf, trainer.update). lr: set before every step
    options = dict(lr=1.0, betas=(0.9, 0.95), fused=True)
    if layout.zero and layout.dp_replicate > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        group = mesh["dp_replicate"].get_group()
        # bucket views: each process's updated share is
        # broadcast as a few flat buffers, not a tensor each
        return ZeroRedundancyOptimizer(
            groups, torch.optim.AdamW, process_group=group, parameters_as_bucket_view=True, **options
        )
    return torch.optim.AdamW(groups, **options)


def local_optimizer(optimizer):
    """The optimizer that holds this process's state:
    ZeroRedundancyOptimizer keeps its share in .optim."""
    return getattr(optimizer, "optim", optimizer)
