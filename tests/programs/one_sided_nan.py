"""train.py, with the loss of step $NAN_STEP NaN on rank 1 alone (a bad batch, an fp16 overflow in its
shard): every process must take the same decision.

Started by tests/gpt/test_gpt_model_parallel.py."""

import os
import runpy
import sys

import torch.distributed as dist
from failures import guards

verdict, calls = guards.verdict, []


def one_sided(loss, norm, stop):
    calls.append(1)
    if dist.get_rank() == 1 and len(calls) == int(os.environ["NAN_STEP"]):
        loss = loss * float("nan")
    return verdict(loss, norm, stop)


guards.verdict = one_sided
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
