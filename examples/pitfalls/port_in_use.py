"""Pitfall: the rendezvous port is taken. Rank 0 hosts the group's store on MASTER_PORT; when another program
(an earlier run that is still alive, a second job on the node) holds that port, rank 0 cannot listen, and
the other ranks wait for a store that is not theirs.

python examples/pitfalls/port_in_use.py [--fixed]    # --fixed: a port that nothing holds
"""

import argparse
import os
import socket
import sys
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank):
    try:
        dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=5))
    except Exception as exc:  # rank 0: the store cannot listen; rank 1: no store answers in time
        first = " ".join(str(exc).split())[:200]
        sys.exit(f"seen: rank {rank}: {type(exc).__name__}: {first}")
    if rank == 0:
        print(f"fixed: the group formed on port {os.environ['MASTER_PORT']}", flush=True)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixed", action="store_true", help="apply the fix")
    args = parser.parse_args()
    holder = socket.socket()  # "another program": it holds the port for as long as we run
    holder.bind(("localhost", 0))
    holder.listen()
    port = holder.getsockname()[1]
    if args.fixed:  # the fix: a port nothing listens on (the lessons do this; torchrun --standalone too)
        with socket.socket() as s:
            s.bind(("localhost", 0))
            port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port))
    try:
        mp.spawn(worker, nprocs=2)
    except mp.ProcessExitedException:
        sys.exit(
            f"cause: port in use: another program holds MASTER_PORT {port}, so rank 0 could not host the "
            "store; fix: a free port (--fixed), or torchrun --standalone, which picks one"
        )


if __name__ == "__main__":
    main()
