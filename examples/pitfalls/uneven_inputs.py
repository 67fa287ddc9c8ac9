"""Pitfall: uneven inputs. One rank has a batch more than the other; its gradient all-reduce waits for a
rank that has left the loop: a hang at the end of an epoch (here cut short by a 3 s timeout).

python examples/pitfalls/uneven_inputs.py [--fixed]    # --fixed: the loop inside Join, replicas identical
"""

import argparse
import os
import re
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn  # before any group: imported later (by DDP) it pins the group and exit aborts
import torch.multiprocessing as mp
from torch.distributed.algorithms import Join
from torch.nn.parallel import DistributedDataParallel as DDP

TIMEOUT = timedelta(seconds=3)  # torch's default is 30 min for gloo, 10 for NCCL: the same hang, longer


def worker(rank, fixed):
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=TIMEOUT)
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(rank)
    batches = [torch.randn(8, 4) for _ in range(3 + rank)]  # rank 0 has 3 batches, rank 1 has 4
    print(f"[rank {rank}] {len(batches)} batches", flush=True)
    try:
        # Join: a rank that runs out of batches answers the others' all-reduces (with zeros) until all are out
        with Join([model], enable=fixed):
            for x in batches:
                optimizer.zero_grad()
                # DDP all-reduces the gradients inside backward(): every rank must come
                model(x).pow(2).mean().backward()
                optimizer.step()
        params = torch.cat([p.detach().flatten() for p in model.parameters()])
        everyone = [torch.empty_like(params) for _ in range(2)]
        dist.all_gather(everyone, params)
    except RuntimeError as exc:
        sys.exit(f"seen: rank {rank}: {one_line(exc)}")
    same = sum(torch.equal(params, other) for other in everyone)
    if same != 2:  # every rank finished, yet the models differ: not fixed
        sys.exit(f"error: rank {rank}: replicas identical on only {same} of 2 ranks")
    if rank == 0:
        print(f"fixed: every rank finished; replicas identical on {same} of 2 ranks", flush=True)
    del model  # the DDP reducer holds the group: release it first, then the group ends cleanly
    dist.destroy_process_group()


def one_line(exc):
    """The error's first line without its C++ source location."""
    line = re.sub(r"^\[[^]]*\] ", "", str(exc).strip().splitlines()[0])
    return f"{type(exc).__name__}: {line}"


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
            "cause: uneven inputs: rank 1's 4th backward() all-reduced gradients that rank 0, out of "
            "batches, never sent; fix: the loop inside Join([model]) (--fixed), or equal batch counts"
        )


if __name__ == "__main__":
    main()
