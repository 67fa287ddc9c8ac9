"""Pitfall: validation over a DistributedSampler's padding. 11 samples on 2 ranks: the sampler repeats one
so that each rank gets 6, and the mean of the ranks' means counts it twice: not one process's loss.

python examples/pitfalls/padded_validation.py [--fixed]    # --fixed: sums and counts of real samples
"""

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

SAMPLES, WORLD = 11, 2


def samples():
    torch.manual_seed(0)
    return torch.randn(SAMPLES, 4), torch.randn(SAMPLES, 1)


def validate(model, rank, fixed):
    data = TensorDataset(*samples())
    # shuffle=False keeps the order; the sampler still pads to a multiple of the world size
    sampler = DistributedSampler(data, WORLD, rank, shuffle=False)
    inputs, targets = next(iter(DataLoader(data, batch_size=SAMPLES, sampler=sampler)))
    losses = F.mse_loss(model(inputs), targets, reduction="none").squeeze(1)
    if not fixed:
        mean = losses.mean()
        dist.all_reduce(mean)
        return mean.item() / WORLD
    # the rank's samples sit at rank, rank + WORLD, ... in the padded list: past SAMPLES is padding
    real = torch.arange(rank, len(sampler) * WORLD, WORLD) < SAMPLES
    totals = torch.stack([losses[real].sum(), real.sum()])
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def worker(rank, fixed):
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 1).requires_grad_(False)
    loss = validate(model, rank, fixed)
    inputs, targets = samples()
    alone = F.mse_loss(model(inputs), targets).item()
    # early stopping: decided from the all-reduced loss, so every rank stops at the same epoch
    stop = torch.tensor([float(loss < 1.0)])
    dist.all_reduce(stop)
    dist.destroy_process_group()
    if rank != 0:
        return
    print(f"seen: validation loss {loss:.6f} on {WORLD} ranks, one process {alone:.6f}", flush=True)
    if abs(loss - alone) > 1e-6:
        sys.exit(1)
    print(f"fixed: the loss of {WORLD} ranks is one process's; stop decided alike on {stop.item():.0f} of 2")


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
            "cause: padded validation: DistributedSampler repeated a sample to give each rank 6 of 11, and "
            "the mean of the ranks' means counted it twice; fix: all-reduce the sums and counts of the real "
            "samples (--fixed), or gather the losses and drop the padding"
        )


if __name__ == "__main__":
    main()
