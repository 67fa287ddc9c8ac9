"""Pitfall: rank 0 evaluates alone through the DDP wrapper. DDP's forward is itself a collective: first
it broadcasts rank 0's buffers (BatchNorm's running statistics) to the others, which are not there. Their
next collective meets that broadcast instead: a mismatch, and both wait until the timeout. Unlike
rank0_alone.py, nothing is slow: the evaluation takes milliseconds, but holds a hidden collective. On the
timeout every process dumps its collectives (examples/gpt/failures/hang.py) and tools/why_hung.py names
both sides.

python examples/pitfalls/rank0_eval_ddp.py [--fixed]    # --fixed: rank 0 evaluates model.module
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
import torch.distributed.nn  # before any group: imported later (by DDP) it pins the group and exit aborts
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples" / "gpt"))
from failures import hang  # noqa: E402  (examples/gpt/failures/hang.py: on a timeout every process dumps its stack and collectives)

TIMEOUT = timedelta(seconds=3)  # short here, so that the failure shows in seconds
VALID = torch.randn(16, 4, generator=torch.Generator().manual_seed(9))  # the validation set


def worker(rank, fixed, folder):
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=TIMEOUT)
    hang.arm(folder, rank, 2)  # a thread that dumps this process's stack when another process asks
    torch.manual_seed(rank)  # each rank its own batches; DDP starts every replica from rank 0's weights
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for epoch in range(2):
            total = torch.zeros(1)
            for _ in range(3):
                optimizer.zero_grad()
                loss = model(torch.randn(8, 4)).pow(2).mean()
                loss.backward()
                optimizer.step()
                total += loss.detach()
            if rank == 0:  # validation on rank 0 alone; the fix: the module inside the wrapper, no collective
                with torch.no_grad():  # eval mode, no gradient: DDP's forward still broadcasts the buffers
                    valid = (model.module if fixed else model).eval()(VALID).pow(2).mean()
                model.train()
            dist.all_reduce(total)  # every rank: the epoch's training loss, for the log line
            if rank == 0:
                print(f"epoch {epoch}: train loss {total.item() / 6:.4f}, validation {valid:.4f}", flush=True)
    except RuntimeError as exc:
        hang.dump(folder, rank, 2, exc)  # and ask the other process to dump too
        sys.exit(f"seen: rank {rank}: {str(exc).split('] ')[-1].splitlines()[0]}")  # without gloo's path
    if rank == 0:
        print("fixed: rank 0 evaluated model.module, outside DDP's collectives", flush=True)
    del model  # the DDP reducer holds the group: release it first, or its teardown can hang the exit
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
        report = subprocess.run([sys.executable, REPO / "tools" / "why_hung.py", folder], capture_output=True)
        said = report.stdout.decode() + report.stderr.decode()  # its last line: the verdict, or its error
        print(said, end="")
        verdict = (said.strip().splitlines() or ["no report"])[-1].removeprefix("verdict: ")
        sys.exit(
            f"cause: rank 0 evaluating through DDP: {verdict}: DDP's forward broadcasts the buffers, which "
            "the others never join; fix: evaluate model.module on rank 0 (--fixed), or on every rank"
        )


if __name__ == "__main__":
    main()
