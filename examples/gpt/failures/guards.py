"""The checks between a step's backward and its optimizer step, kept on the device. The loss,
the gradient norm and whether a stop was asked for (preempt.py) are all-reduced together, one
collective of three numbers per step, so every process takes the same decision from the same
numbers. An ordinary step reads nothing back: a step whose loss or gradients are not finite
is skipped by fused AdamW itself (found_inf), and fp16's loss scale moves on the device. The
host reads the checks of every step since its last read at once, on the steps that log,
evaluate or save (Checks): there it counts skipped steps, stops a run that diverged, and
takes the decision to save and stop."""

import math

import torch
import torch.distributed as dist
from parallel.dtensors import local, whole


class Diverged(Exception):
    """The loss or the gradient norm is no longer finite:
    the run stops before any snapshot holds it."""


def verdict(loss, norm, stop):
    """A device tensor: (the mean loss over the processes, this process's gradient norm, the sum of
    every process's norm, the number of processes asked to stop). A NaN or an infinity on one
    process reaches every process's sum, so all skip alike."""
    norm = whole(norm).float()  # FSDP's and tp's norm is a DTensor
    # new_full fills on the device: a tensor made from
    # a host value would wait for the device's queue
    shared = torch.stack([loss.float(), norm, loss.new_full((), float(stop))])
    if dist.is_initialized():
        dist.all_reduce(shared)
        shared[0] /= dist.get_world_size()
    return torch.stack([shared[0], norm, shared[1], shared[2]])


def skip(values):
    """1.0 where the step must not update (a loss or some process's gradient not finite), else 0.0:
    what fused AdamW's found_inf and the loss scale's update take, on the device."""
    return (~(values[0].isfinite() & values[2].isfinite())).float()


# fp16: gradients that overflowed this many steps in a row, the loss scale halved at each (2**16 down to
# 2**-8), overflow at any scale: the run diverged, where the scale would go on halving for ever
OVERFLOWS_IN_A_ROW = 24


class Checks:
    """The host's side of the checks: the verdicts of the steps it has not read yet, read at
    once (one transfer) on a step that logs, evaluates or saves. A skipped step is logged
    and counted against --skip_nonfinite (fp16's overflows are the loss scale's, not
    counted, up to OVERFLOWS_IN_A_ROW); past those, Diverged, before the step's update and
    any save. Keeps the finite losses since the last log line."""

    def __init__(self, skip_nonfinite, scaled, log):
        self.skip_nonfinite, self.scaled, self.log = skip_nonfinite, scaled, log
        self.pending, self.losses, self.skipped, self.overflows = [], [], 0, 0

    def add(self, step, values):
        self.pending.append((step, values))

    def read(self):
        """The last step's (gradient norm, loss finite, stop asked), every pending
        step checked. The norm reported is this process's where every process's is
        finite, else their non-finite sum."""
        rows = torch.stack([values for _, values in self.pending]).tolist()
        for (step, _), (loss, norm, norms, _) in zip(self.pending, rows, strict=True):
            loss_ok, norm_ok = math.isfinite(loss), math.isfinite(norms)
            norm = norm if norm_ok else norms
            if loss_ok:
                self.losses.append(loss)
            self.overflows = 0 if norm_ok else self.overflows + 1
            if loss_ok and self.scaled and self.overflows >= OVERFLOWS_IN_A_ROW:
                raise Diverged(
                    f"fp16 gradients overflowed {self.overflows} steps in a row, the last at step {step}: "
                    "halving the loss scale each time did not help (try --dtype bf16 or fp32)"
                )
            if loss_ok and (norm_ok or self.scaled):
                continue
            what, value = ("loss", loss) if not loss_ok else ("gradient norm", norm)
            if self.skipped >= self.skip_nonfinite:
                raise Diverged(f"the {what} became {value} at step {step}")
            self.skipped += 1
            self.log(f"step {step}: loss {loss}, gradient norm {norm}: skipped "
                     f"({self.skipped} of --skip_nonfinite {self.skip_nonfinite})")  # fmt: skip
        self.pending = []
        return norm, loss_ok, rows[-1][3] > 0

    def mean_loss(self):
        """The mean of the finite losses since the last call."""
        losses, self.losses = self.losses, []
        return sum(losses) / len(losses) if losses else math.nan


class LossScaler:
    """fp16's dynamic loss scale, on the device (GradScaler's rule and torch's kernel for it: halve
    it when a step is skipped, double it after `interval` clean steps). Whether a step is skipped
    comes from verdict(), so every process skips the same steps whatever the layout; GradScaler's
    own unscale_ decides per process."""

    def __init__(self, enabled, scale=2.0**16, interval=2000, device=None):
        self.enabled, self.interval = enabled, interval
        self.value = torch.full((), scale, device=device)
        self.clean = torch.zeros((), dtype=torch.int32, device=device)

    def scale(self, loss):
        return loss * self.value if self.enabled else loss

    def unscale(self, params):
        if not self.enabled:  # fp16 alone scales its loss
            return
        grads = [local(p.grad) for p in params if p.grad is not None]
        if grads:
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
