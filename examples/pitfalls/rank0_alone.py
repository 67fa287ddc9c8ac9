"""Pitfall: rank 0 works alone (saves, evaluates, logs to a slow disk) while the other ranks go on to the
next collective. They wait for rank 0 there; if its work takes longer than the timeout, the run fails, and
with torch's default timeouts (30 min gloo, 10 min NCCL) it looks like a hang first. On the timeout, every
process dumps its stack (examples/gpt/failures/hang.py) and tools/why_hung.py names the one outside the
collective.

python examples/pitfalls/rank0_alone.py [--fixed]    # --fixed: every rank takes its share of the work
"""

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples" / "gpt"))
from failures import hang  # noqa: E402  (examples/gpt/failures/hang.py: on a timeout every process dumps its stack and collectives)

TIMEOUT = timedelta(seconds=3)  # short here, so that the failure shows in seconds
WORK = 6.0  # seconds of evaluation in all: longer than the timeout when one rank does it alone


def evaluate(share):
    time.sleep(WORK * share)  # stands for validation batches, or writing a big snapshot
    return torch.tensor([share])


def worker(rank, fixed, folder):
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=TIMEOUT)
    hang.arm(folder, rank, 2)  # a thread that dumps this process's stack when another process asks
    try:
        if fixed:  # the fix: every rank evaluates half, then they meet, well within the timeout
            done = evaluate(0.5)
            dist.all_reduce(done)
        else:
            if rank == 0:
                evaluate(1.0)
            # monitored_barrier, not a bare collective: the rank that waited says whom it waited for
            dist.monitored_barrier(timeout=TIMEOUT)
    except RuntimeError as exc:
        hang.dump(folder, rank, 2, exc)  # and ask the other process to dump too
        message = " ".join(str(exc).split(" Original exception:")[0].split())  # without gloo's source path
        sys.exit(f"seen: rank {rank}: {message[:240]}")
    if rank == 0:
        print(f"fixed: each rank evaluated half ({WORK / 2:g} s), met within {TIMEOUT.seconds} s", flush=True)
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
            f"cause: {verdict}: it works alone ({WORK:g} s) past the {TIMEOUT.seconds} s timeout; fix: share "
            "the work among the ranks (--fixed), or a barrier whose timeout covers the work"
        )


if __name__ == "__main__":
    main()
