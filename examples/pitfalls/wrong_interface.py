"""Pitfall: gloo bound to the wrong network interface. GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME for NCCL) picks
the interface whose address the ranks publish to each other; one that does not exist on a node, or cannot
reach the other nodes (docker0, lo across machines), stops the group from forming.

python examples/pitfalls/wrong_interface.py [--fixed]    # --fixed: an interface that exists (make doctor)
"""

import argparse
import os
import re
import socket
import sys
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank):
    try:
        dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=5))
    except Exception as exc:
        first = re.sub(r"^\[[^]]*\] ", "", " ".join(str(exc).split()))[:200]  # without the C++ source line
        sys.exit(f"seen: rank {rank}: {type(exc).__name__}: {first}")
    if rank == 0:
        print(f"fixed: the group formed over {os.environ['GLOO_SOCKET_IFNAME']}", flush=True)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixed", action="store_true", help="apply the fix")
    args = parser.parse_args()
    # the fix: name an interface that exists here and reaches the other nodes. Across machines, the one
    # holding the address the nodes use for each other (`make doctor` lists them; `ip -br addr` too).
    # One machine here, so the loopback interface; a typo or a copied config gives the broken case.
    names = [name for _, name in socket.if_nameindex()]
    ifname = next(n for n in names if n.startswith("lo")) if args.fixed else "eth9"
    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    with socket.socket() as s:  # a free port for the group's store
        s.bind(("localhost", 0))
        os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(s.getsockname()[1]))
    try:
        mp.spawn(worker, nprocs=2)
    except mp.ProcessExitedException:
        sys.exit(
            f"cause: wrong interface: GLOO_SOCKET_IFNAME={ifname} names no interface of this machine (it has "
            f"{', '.join(names)}); fix: the interface that reaches the other nodes (--fixed; make doctor)"
        )


if __name__ == "__main__":
    main()
