"""How a run fails, in one place: what it says and how the process ends.

    refuse(prog, message)         bad input, found before training: argparse's usage and exit status 2
    fail(message)                 a failure every process meets alike (a snapshot it cannot use, divergence)
    diverged(exc, snapshot_path)  a loss or gradient norm that is not finite: what was kept, what to try
    timed_out(args, rank, world, exc)   a wait past --dist_timeout: every live process's stack, one line
    leave(status)                 how each of them ends the process (why: below)

Alone, a message goes to stderr. Under torchrun it is said once per node, as the error of
torchrun's closing summary: each node's local rank 0 fails with it through torch's `record` (which
writes the error file the summary reads), and the node's other processes end quietly (0).
"""

import os
import sys

import torch
from snapshots import checkpoint
from torch.distributed.elastic.multiprocessing.errors import record

from failures import hang


def refuse(prog, message):
    """Bad input (argparse's errors, and any found before training): exit status 2."""
    fail(f"{prog}: error: {message}", 2)


class Failed(Exception):
    """The message of a failure that every process meets alike."""


def fail(message, status=1):
    """End the run with `message`, for a failure that every process meets alike."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        print(message, file=sys.stderr)
        leave(status)
    if os.environ.get("LOCAL_RANK", "0") != "0":
        leave(0)
    try:
        record(say)(message)
    except Failed:
        leave(status)


def say(message):
    """What record writes to torchrun's error file:
    this message, and no exception it was handling."""
    raise Failed(message) from None


def diverged(exc, snapshot_path):
    """Every process decided it from the same all-reduced numbers, before the step's update."""
    newest = checkpoint.latest(snapshot_path) if os.path.isdir(snapshot_path) else None
    kept = f"the newest snapshot is {newest}" if newest else "nothing was saved"
    fail(
        f"error: {exc}, before its update: training stopped, {kept}. Lower --lr, or raise --warmup_steps, "
        "or pass --skip_nonfinite N"
    )


def timed_out(args, rank, world, exc):
    """A wait past --dist_timeout, or a collective whose connection another process closed (gloo's,
    when that process timed out first or died): this process's stack and flight recorder, and every
    other live process's, into SNAPSHOT_PATH/hang (hang.py), then a one-line error naming the
    report. Any other error is raised."""
    why = hang.cause(exc)
    if why is None:
        raise exc
    silent = hang.dump(args.snapshot_path, rank, world, exc)
    detail = str(exc).strip().splitlines()[0]
    dumped = f"all but processes {silent}" if silent else "every process"
    said = (
        "lost its connection to another process, which gave up first or died"
        if why == "lost"
        else f"waited more than --dist_timeout {args.dist_timeout:g} s for the others, which stalled or died"
    )
    where = f"{args.snapshot_path}/hang: make why-hung RUN={args.snapshot_path} says which waits where"
    print(f"error: process {rank} {said} ({detail}); {dumped} wrote its stack to {where}", file=sys.stderr)
    leave(1)


def leave(status, group_formed=None):
    """End the process. Once a process group has formed (group_formed; default: one is
    initialized now), without the interpreter's shutdown: torch keeps the group reachable
    after destroy_process_group (DDP's reference cycles, DTensor's caches), so its gloo
    threads would still run while the interpreter shuts down, where a finished run was seen
    to abort (SIGABRT, exit -6)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if group_formed or (group_formed is None and torch.distributed.is_initialized()):
        os._exit(status)
    sys.exit(status)
