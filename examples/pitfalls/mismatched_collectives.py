"""Pitfall: collectives that differ between ranks. Rank 0 all-reduces while rank 1 broadcasts (a branch on
the rank): each waits for a partner that never comes, a hang until the timeout, or worse, a silent mix-up.
On the timeout each process dumps its collectives (examples/gpt/failures/hang.py) and tools/why_hung.py
names both sides; TORCH_DISTRIBUTED_DEBUG=DETAIL would check every collective first, at a cost in each.

python examples/pitfalls/mismatched_collectives.py [--fixed]    # --fixed: the same calls on every rank
"""

import argparse
import os
import socket
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples" / "gpt"))
from failures import hang  # noqa: E402  (examples/gpt/failures/hang.py: on a timeout every process dumps its stack and collectives)


def worker(rank, fixed, folder):
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=5))
    hang.arm(folder, rank, 2)
    metric = torch.tensor([float(rank + 1)])
    try:
        if fixed or rank == 0:  # the fix: every rank runs the same collectives, in the same order
            dist.all_reduce(metric)
        else:  # e.g. "only rank 1 has something to share": a branch on the rank around a collective
            dist.broadcast(metric, src=1)
    except RuntimeError as exc:
        hang.dump(folder, rank, 2, exc)  # and ask the other process to dump too
        sys.exit(f"seen: rank {rank}: {str(exc).split('] ')[-1].splitlines()[0]}")  # without gloo's path
    if rank == 0:
        print(f"fixed: both ranks all-reduced, sum {metric.item():g}", flush=True)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixed", action="store_true", help="apply the fix")
    args = parser.parse_args()
    with socket.socket() as s:  # a free port for the group's store
        s.bind(("localhost", 0))
        os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(s.getsockname()[1]))
    folder = Path(tempfile.gettempdir()) / f"why-hung-{os.getpid()}"  # the dumps, if a timeout comes
    hang.record(folder, nccl=False)  # before the group forms: torch records every collective
    try:
        mp.spawn(worker, args=(args.fixed, folder), nprocs=2)
    except mp.ProcessExitedException:
        # which process is in which collective, from those dumps: `make why-hung RUN=folder`
        report = subprocess.run([sys.executable, REPO / "tools" / "why_hung.py", folder], capture_output=True)
        said = report.stdout.decode() + report.stderr.decode()  # its last line: the verdict, or its error
        print(said, end="")
        verdict = (said.strip().splitlines() or ["no report"])[-1].removeprefix("verdict: ")
        sys.exit(
            f"cause: mismatched collectives: {verdict}; fix: the same collectives in the same order on every "
            "rank (--fixed)"
        )


if __name__ == "__main__":
    main()
