"""The checks between a step's backward and its optimizer step. The loss, the gradient norm and whether a
stop was asked for (preempt.py) are all-reduced together, one collective of three numbers per step, so
every process takes the same decision from the same numbers: update, skip, save and stop, or stop."""

import math

import torch
import torch.distributed as dist
from parallel import local


class Diverged(Exception):
    """The loss or the gradient norm is no longer finite: the run stops before the update."""


def verdict(loss, norm, stop):
    """(the mean loss over the processes, this process's gradient norm (or, where some process's is not
    finite, their non-finite sum), whether every process's loss is finite, whether every process's
    gradient norm is finite, whether any process was asked to stop). A NaN or an infinity on one process
    reaches every process's sum."""
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP's clip returns a DTensor
    values = torch.stack([loss.float(), norm.float(), loss.new_tensor(float(stop))])
    if dist.is_initialized():
        dist.all_reduce(values)
        values[0] /= dist.get_world_size()
    loss, norms, stops = values.tolist()
    # a norm non-finite on some process is the one every process reports (the sum is then inf or nan)
    norm = norm.item() if math.isfinite(norms) else norms
    return loss, norm, math.isfinite(loss), math.isfinite(norms), stops > 0


class LossScaler:
    """fp16's dynamic loss scale (GradScaler's rule: halve it and skip the step when a gradient overflows,
    double it after `interval` clean steps). Whether a gradient overflowed is read from verdict(), so every
    process skips the same steps whatever the layout; GradScaler's own unscale_ decides per process and
    refuses a mix of tensors and DTensors (tensor parallel's replicated and split parameters)."""

    def __init__(self, enabled, scale=2.0**16, interval=2000):
        self.enabled, self.value, self.interval, self.clean = enabled, scale, interval, 0

    def scale(self, loss):
        return loss * self.value if self.enabled else loss

    def unscale(self, params):
        if self.enabled:
            for p in params:
                if p.grad is not None:
                    local(p.grad).mul_(1 / self.value)

    def update(self, overflow):
        if not self.enabled:
            return
        self.clean = 0 if overflow else self.clean + 1
        if overflow:
            self.value /= 2
        elif self.clean == self.interval:
            self.value, self.clean = self.value * 2, 0

    def state_dict(self):  # GradScaler's keys, which older snapshots hold
        return {"scale": self.value, "_growth_tracker": self.clean} if self.enabled else {}

    def load_state_dict(self, state):
        if self.enabled and state:
            self.value, self.clean = float(state["scale"]), int(state["_growth_tracker"])
