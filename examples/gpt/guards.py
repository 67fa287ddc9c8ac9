"""The checks between a step's backward and its optimizer step, kept on the device. The loss, the gradient
norm and whether a stop was asked for (preempt.py) are all-reduced together, one collective of three
numbers per step, so every process takes the same decision from the same numbers. An ordinary step reads
nothing back: a step whose loss or gradients are not finite is skipped by fused AdamW itself (found_inf),
and fp16's loss scale moves on the device. The host reads the checks of every step since its last read
at once, on the steps that log, evaluate or save (read()): there it counts skipped steps, stops a run
that diverged, and takes the decision to save and stop."""

import math

import torch
import torch.distributed as dist
from parallel import local, whole


class Diverged(Exception):
    """The loss or the gradient norm is no longer finite: the run stops before any snapshot holds it."""


def verdict(loss, norm, stop):
    """A device tensor: (the mean loss over the processes, this process's gradient norm, the sum of every
    process's norm, the number of processes asked to stop). A NaN or an infinity on one process reaches
    every process's sum, so all skip alike."""
    norm = whole(norm).float()  # FSDP's and tp's norm is a DTensor
    # new_full fills on the device: a tensor made from a host value would wait for the device's queue
    shared = torch.stack([loss.float(), norm, loss.new_full((), float(stop))])
    if dist.is_initialized():
        dist.all_reduce(shared)
        shared[0] /= dist.get_world_size()
    return torch.stack([shared[0], norm, shared[1], shared[2]])


def skip(values):
    """1.0 where the step must not update (a loss or some process's gradient not finite), else 0.0: what
    fused AdamW's found_inf and the loss scale's update take, on the device."""
    return (~(values[0].isfinite() & values[2].isfinite())).float()


def read(pending):
    """[(step, mean loss, gradient norm, loss finite, norms finite, stop asked)] for pending, a list of
    (step, verdict): one read of the device for all of them. The norm reported is this process's where
    every process's is finite, else their non-finite sum."""
    rows = torch.stack([values for _, values in pending]).tolist()
    out = []
    for (step, _), (loss, norm, norms, stops) in zip(pending, rows, strict=True):
        finite = math.isfinite(norms)
        out.append((step, loss, norm if finite else norms, math.isfinite(loss), finite, stops > 0))
    return out


class LossScaler:
    """fp16's dynamic loss scale, on the device (GradScaler's rule and torch's kernel for it: halve it when
    a step is skipped, double it after `interval` clean steps). Whether a step is skipped comes from
    verdict(), so every process skips the same steps whatever the layout; GradScaler's own unscale_
    decides per process."""

    def __init__(self, enabled, scale=2.0**16, interval=2000, device=None):
        self.enabled, self.interval = enabled, interval
        self.value = torch.full((), scale, device=device)
        self.clean = torch.zeros((), dtype=torch.int32, device=device)

    def scale(self, loss):
        return loss * self.value if self.enabled else loss

    def unscale(self, params):
        grads = [local(p.grad) for p in params if p.grad is not None]
        if self.enabled and grads:
            torch._foreach_mul_(grads, self.value.reciprocal())

    def update(self, skipped):
        """skipped: 1.0 (or True) for a skipped step, as skip() gives it."""
        if self.enabled:
            found = torch.as_tensor(skipped, dtype=torch.float32, device=self.value.device)
            torch._amp_update_scale_(self.value, self.clean, found, 2.0, 0.5, self.interval)

    def state_dict(self):  # GradScaler's keys, which older snapshots hold
        return {"scale": self.value.item(), "_growth_tracker": int(self.clean)} if self.enabled else {}

    def load_state_dict(self, state):
        if self.enabled and state:
            self.value.fill_(float(state["scale"]))
            self.clean.fill_(int(state["_growth_tracker"]))
