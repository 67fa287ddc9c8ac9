"""Runs train.py, but SIGKILLs process 0 when it is about to write extra.pt of its second snapshot: every
process has written its shards by then, and the pointer still names the first.

Started by tests/gpt/test_gpt_sharding.py and test_gpt_model_parallel.py."""

import os
import runpy
import signal
import sys

from snapshots import checkpoint

save_file = checkpoint.save_file
saves = []


def dying_save(path, state):
    saves.append(state["step"])
    if len(saves) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    save_file(path, state)


checkpoint.save_file = dying_save
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
