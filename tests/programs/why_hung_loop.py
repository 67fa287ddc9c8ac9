"""Two gloo processes that record their collectives (hang.record) and all-reduce in a loop until one is
stopped (SIGSTOP) from outside: the other waits past the timeout (argv[2] seconds) and dumps (hang.dump),
asking the stopped one: the folder (argv[1]) that why_hung.py reads.

Started by tests/repo/test_why_hung.py."""

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from failures import hang

folder = Path(sys.argv[1])
hang.record(folder)
dist.init_process_group("gloo", timeout=timedelta(seconds=float(sys.argv[2])))
rank, world = dist.get_rank(), dist.get_world_size()
(folder / f"pid{rank}").write_text(str(os.getpid()))
hang.arm(folder, rank, world)
total = torch.ones(1)
try:
    for step in range(100_000):
        dist.all_reduce(total)  # the collective that rank 1, stopped, never joins
        if step == 20:
            (folder / f"ready{rank}").write_text("")
        time.sleep(0.02)
except RuntimeError as exc:
    silent = hang.dump(folder, rank, world, exc, wait=3)
    (folder / f"done{rank}").write_text(str(silent))
    sys.exit(1)
