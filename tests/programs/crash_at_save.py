"""Runs train.py, but SIGKILLs process 0 when it is about to write extra.pt of the step-40 snapshot: every
process has written its shards by then, and the pointer still names step 20.

Started by tests/gpt/test_gpt_sharding.py."""

import os
import runpy
import signal
import sys

from snapshots import checkpoint

save_file = checkpoint.save_file


def dying_save(path, state):
    if state["step"] == 40:
        os.kill(os.getpid(), signal.SIGKILL)
    save_file(path, state)


checkpoint.save_file = dying_save
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
