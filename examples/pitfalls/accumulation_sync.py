"""Pitfall: gradient accumulation that all-reduces every micro-batch. The step comes out right, but at one
all-reduce of all the gradients per micro-batch, not one per step. Here no_sync() wraps the backward only:
DDP decides in the forward whether the backward all-reduces, so each one still does (a hook counts them).

python examples/pitfalls/accumulation_sync.py [--fixed]    # --fixed: no_sync around forward and backward
"""

import argparse
import contextlib
import copy
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn  # before any group: imported later (by DDP) it pins the group and exit aborts
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import parameters_to_vector as flat

WORLD, MICRO, STEPS = 2, 4, 3  # ranks, micro-batches a step, steps


def batch(step):  # the step's large batch: 8 samples for each of the WORLD * MICRO micro-batches
    inputs = torch.randn(WORLD * MICRO * 8, 16, generator=torch.Generator().manual_seed(step))
    return inputs, inputs.sum(1, keepdim=True).sin()


def worker(rank, fixed):
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=10))
    torch.manual_seed(0)
    alone = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    model, calls = DDP(copy.deepcopy(alone)), []
    # DDP's own all-reduce of a bucket of gradients, counted: a small model, one bucket, one call a backward
    model.register_comm_hook(calls, lambda calls, bucket: calls.append(1) or allreduce_hook(None, bucket))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        inputs, targets = (both.chunk(WORLD)[rank].chunk(MICRO) for both in batch(step))
        optimizer.zero_grad()
        for i, (x, y) in enumerate(zip(inputs, targets, strict=True)):
            # all micro-batches but the last add to the gradients here; the last one's backward all-reduces
            hold = model.no_sync if i < MICRO - 1 else contextlib.nullcontext
            with hold() if fixed else contextlib.nullcontext():  # the fix: the forward inside no_sync too
                loss = F.mse_loss(model(x), y) / MICRO
                with contextlib.nullcontext() if fixed else hold():  # the pitfall: around the backward only
                    loss.backward()
        optimizer.step()
    replicas = [torch.empty_like(flat(model.parameters())) for _ in range(WORLD)]
    dist.all_gather(replicas, flat(model.parameters()).detach())
    del model  # the DDP reducer holds the group: release it first, or its teardown can hang the exit
    dist.destroy_process_group()
    if rank != 0:
        return
    optimizer = torch.optim.SGD(alone.parameters(), lr=0.1)  # one process, the large batch: the reference
    for step in range(STEPS):
        optimizer.zero_grad()
        F.mse_loss(alone(batch(step)[0]), batch(step)[1]).backward()
        optimizer.step()
    apart, off = (replicas[1] - replicas[0]).abs().max(), (flat(alone.parameters()) - replicas[0]).abs().max()
    print(f"seen: {len(calls)} all-reduces in {STEPS} steps of {MICRO} micro-batches", flush=True)
    print(f"replicas apart by {apart:.2g}, off one process's large batch by {off:.2g}", flush=True)
    if len(calls) != STEPS or max(apart, off) > 1e-5:
        sys.exit(1)
    print(f"fixed: one all-reduce a step; {MICRO} micro-batches on {WORLD} ranks step as one large batch")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixed", action="store_true", help="apply the fix")
    args = parser.parse_args()
    with socket.socket() as s:  # a free port for the group's store
        s.bind(("localhost", 0))
        os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(s.getsockname()[1]))
    try:
        mp.spawn(worker, args=(args.fixed,), nprocs=WORLD)
    except mp.ProcessExitedException:
        sys.exit(
            f"cause: accumulation all-reduces every micro-batch: {MICRO} a step, not one (no_sync around the "
            "backward only: DDP decides in the forward); fix: no_sync around forward and backward (--fixed)"
        )


if __name__ == "__main__":
    main()
