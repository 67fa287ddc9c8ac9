"""train.py under DDP, with an infinity in one gradient of rank 1 alone after step 3's all-reduce (its own
overflow): the loss stays finite, only rank 1's gradient norm is not. FP16=1 (with --dtype fp16): the
loss scale doubles after 3 clean steps. Each process writes, after every
update, the step, the scale and whether its weights moved, into steps{rank}.txt.

Started by tests/gpt/test_gpt_model_parallel.py."""

import os
import runpy
import sys

import parallel
import torch.distributed as dist
import trainer
from failures import guards
from parallel.dtensors import local

if os.environ.get("FP16") == "1":

    class Scaler(guards.LossScaler):
        def __init__(self, enabled, scale, **kwargs):
            super().__init__(enabled, scale, interval=3, **kwargs)

    guards.LossScaler = Scaler
clip, calls = parallel.clip_grad_norm_, []


def overflowed(par, max_norm):
    calls.append(1)
    if dist.get_rank() == 1 and len(calls) == 3:
        grad = next(p.grad for p in par.module.parameters() if p.grad is not None)
        local(grad).view(-1)[0] = float("inf")
    return clip(par, max_norm)


parallel.clip_grad_norm_ = overflowed
update = trainer.Trainer.update


def reported(self, *args):
    before = [p.detach().clone() for p in self.raw.parameters()]
    update(self, *args)
    moved = any(not a.equal(b) for a, b in zip(before, self.raw.parameters(), strict=True))
    with open(f"steps{self.rank}.txt", "a") as f:
        f.write(f"{self.step} {float(self.scaler.value)} {moved}\n")


trainer.Trainer.update = reported
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
