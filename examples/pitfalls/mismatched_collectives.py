"""Pitfall: collectives that differ between ranks. Rank 0 all-reduces while rank 1 broadcasts (a branch on
the rank): each waits for a partner that never comes, a hang until the timeout, or worse, a silent mix-up.
TORCH_DISTRIBUTED_DEBUG=DETAIL checks every collective first and names both sides.

python examples/pitfalls/mismatched_collectives.py [--fixed]    # --fixed: the same calls on every rank
"""

import argparse
import os
import re
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, fixed):
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=10))
    metric = torch.tensor([float(rank + 1)])
    try:
        if fixed or rank == 0:  # the fix: every rank runs the same collectives, in the same order
            dist.all_reduce(metric)
        else:  # e.g. "only rank 1 has something to share": a branch on the rank around a collective
            dist.broadcast(metric, src=1)
    except RuntimeError as exc:
        ops = re.findall(r"Rank (\d+) is running collective: \w+\(SequenceNumber=\d+, OpType=(\w+)", str(exc))
        sys.exit(
            f"seen: rank {rank}: {str(exc).split('.')[0]}: " + ", ".join(f"rank {r} {op}" for r, op in ops)
        )
    if rank == 0:
        print(f"fixed: both ranks all-reduced, sum {metric.item():g}", flush=True)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixed", action="store_true", help="apply the fix")
    args = parser.parse_args()
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"  # before the group forms: it wraps every collective
    with socket.socket() as s:  # a free port for the group's store
        s.bind(("localhost", 0))
        os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(s.getsockname()[1]))
    try:
        mp.spawn(worker, args=(args.fixed,), nprocs=2)
    except mp.ProcessExitedException:
        sys.exit(
            "cause: mismatched collectives: rank 0 called all_reduce, rank 1 broadcast; fix: the same "
            "collectives in the same order on every rank (--fixed); TORCH_DISTRIBUTED_DEBUG=DETAIL names them"
        )


if __name__ == "__main__":
    main()
