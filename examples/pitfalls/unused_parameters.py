"""Pitfall: a parameter that gets no gradient. DDP waits for every parameter's gradient before it can finish
a step's all-reduce; a layer the forward pass skipped never sends one, and the next step fails.

python examples/pitfalls/unused_parameters.py [--fixed]    # --fixed: find_unused_parameters=True
"""

import argparse
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn  # before any group: imported later (by DDP) it pins the group and exit aborts
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(4, 4)
        self.head_a, self.head_b = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)

    def forward(self, x, task):  # one head per batch: the other idles
        head = self.head_a if task == "a" else self.head_b
        return head(self.body(x))


def worker(rank, fixed):
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=10))
    torch.manual_seed(0)
    # find_unused_parameters: after each forward DDP walks the graph and marks the idle head ready at once.
    # It costs that walk every step; without idle parameters, leave it off (the default)
    model = DDP(TwoHeads(), find_unused_parameters=fixed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step in range(3):
            optimizer.zero_grad()
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + rank))
            model(x, task="a").pow(2).mean().backward()
            optimizer.step()
    except RuntimeError as exc:
        sys.exit(f"seen: rank {rank}, step {step}: {str(exc).strip().split('. ')[0]}")
    if rank == 0:
        print("fixed: 3 steps with head_b idle, DDP told to expect unused parameters", flush=True)
    del model  # the DDP reducer holds the group: release it first, or its teardown can hang the exit
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixed", action="store_true", help="apply the fix")
    args = parser.parse_args()
    with socket.socket() as s:  # a free port for the group's store
        s.bind(("localhost", 0))
        os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(s.getsockname()[1]))
    try:
        mp.spawn(worker, args=(args.fixed,), nprocs=2)
    except mp.ProcessExitedException:
        sys.exit(
            "cause: unused parameters: head_b took no part in the forward pass, so DDP never got its "
            "gradient; fix: find_unused_parameters=True (--fixed), or no branch that leaves parameters out"
        )


if __name__ == "__main__":
    main()
