"""Gradient clipping over the whole model, wherever its parts live: DTensors' norms include
the parts other processes hold, a pipeline's stages add their squares, the tied embedding
counted once."""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from parallel.pipeline_parallel import Pipeline


def counted_once(parallel):
    """The parameters whose squares enter the gradient norm here: all, but the
    last stage's copy of the tied embedding (the first stage counts it)."""
    params = [p for p in parallel.module.parameters() if p.grad is not None]
    if isinstance(parallel, Pipeline) and parallel.last and not parallel.first:
        return params, [p for p in params if p is not parallel.module.tok_emb.weight]
    return params, params


def clip_grad_norm_(parallel, max_norm):
    """Gradient clipping over the whole model with torch's own functions, wherever its parts live:
    the total norm of this process's gradients (a DTensor's norm includes the parts other processes
    hold along the mesh dimensions it is split over), its square summed over the pipeline's stages,
    then every gradient scaled by the same factor as in one process."""
    params, counted = counted_once(parallel)
    norm = torch.nn.utils.get_total_norm([p.grad for p in counted])
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if isinstance(parallel, Pipeline):
        squares = norm.float().square()
        dist.all_reduce(squares, group=parallel.group)
        norm = squares.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
