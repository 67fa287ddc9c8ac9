"""Pitfall: BatchNorm under DDP normalizes each process's batch alone. With 4 images a process, the statistics
differ from one process's over all 8: the loss, the step and, in eval mode, rank 0's running statistics.

python examples/pitfalls/batchnorm_stats.py [--fixed]    # --fixed: SyncBatchNorm, on 2 GPUs (CUDA only)
"""

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORLD, BATCH, TOLERANCE = 2, 4, 1e-4  # the tolerance: float32 summed in another order
torch.backends.cudnn.allow_tf32 = False  # float32 convolutions on GPUs too: only the statistics differ
torch.manual_seed(1)
# brighter with their index, as data read in order: each process's 4 images are not like all 8
ALL_IMAGES = torch.randn(WORLD * BATCH, 3, 8, 8) + torch.arange(WORLD * BATCH).view(-1, 1, 1, 1) / 2
ALL_LABELS = torch.randint(10, (WORLD * BATCH,))


def make_model():
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1)]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(8, 10))


def step(model, images, labels):
    """One SGD step in train mode, then the eval-mode outputs on every image."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = F.cross_entropy(model(images), labels)
    loss.backward()
    optimizer.step()
    model.eval()
    return loss.detach(), model(ALL_IMAGES.to(images.device)).detach()


def worker(rank, fixed, on_gpus, store):
    device = torch.device(f"cuda:{rank}" if on_gpus else "cpu")
    if on_gpus:
        torch.cuda.set_device(device)
    backend = "nccl" if on_gpus else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=WORLD)
    model = make_model().to(device)
    if fixed:
        # the fix, before DDP: every BatchNorm computes its statistics over all the processes' batches
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    loss, outputs = step(DDP(model), ALL_IMAGES[mine].to(device), ALL_LABELS[mine].to(device))
    dist.all_reduce(loss)
    alone_loss, alone_outputs = step(make_model().to(device), ALL_IMAGES.to(device), ALL_LABELS.to(device))
    gaps = [(loss / WORLD - alone_loss).abs().item(), (outputs - alone_outputs).abs().max().item()]
    dist.destroy_process_group()
    if rank == 0:
        print(f"seen: loss off one process's by {gaps[0]:.2g}, eval outputs by {gaps[1]:.2g}", flush=True)
        if max(gaps) > TOLERANCE:
            sys.exit(1)
        print(f"fixed: {WORLD} processes of {BATCH} images train and evaluate as one of {WORLD * BATCH}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixed", action="store_true", help="apply the fix")
    args = parser.parse_args()
    on_gpus = torch.cuda.device_count() >= WORLD
    if args.fixed and not on_gpus:
        parser.error(f"--fixed needs {WORLD} GPUs: torch runs SyncBatchNorm on CUDA only")
    # the processes meet through a file: no port to choose
    store = os.path.join(tempfile.mkdtemp(), "store")
    try:
        mp.spawn(worker, args=(args.fixed, on_gpus, store), nprocs=WORLD)
    except mp.ProcessExitedException:
        sys.exit(
            f"cause: per-process BatchNorm: {WORLD} processes normalized {BATCH} images each alone, and "
            "eval used rank 0's running statistics; fix: convert_sync_batchnorm before DDP (--fixed)"
        )


if __name__ == "__main__":
    main()
