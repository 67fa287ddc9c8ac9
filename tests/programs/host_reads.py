"""Runs the GPT trainer (sys.argv[1], then its arguments) and counts, for each training step, the values
examples/gpt reads back from tensors (item, tolist, bool, float, int, numpy): on a GPU each such read waits
for everything queued before it. Writes reads.rank{RANK}.json: {"reads": {step: count}, "checked": [the
steps whose checks the host read], "one_kind": whether the parameters are all DTensors or none, "foreach":
whether a foreach AdamW steps over them (it refuses a mix)}. On a GPU, CUDA's sync debug mode also warns
of every synchronising call in the steps, counted as reads too."""

import json
import runpy
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import trainer  # from the package on PYTHONPATH, which the test sets
from torch.distributed.tensor import DTensor

GPT = Path(trainer.__file__).resolve().parent

reads, checked, state = {}, [], {"step": 0}


def counting(name):
    original = getattr(torch.Tensor, name)

    def read(self, *args, **kwargs):
        if state["step"] and GPT in Path(sys._getframe(1).f_code.co_filename).parents:  # step 1 on
            reads[state["step"]] = reads.get(state["step"], 0) + 1
        return original(self, *args, **kwargs)

    setattr(torch.Tensor, name, read)


for method in ("item", "tolist", "__bool__", "__float__", "__int__", "numpy"):
    counting(method)

train_step, update = trainer.Trainer.train_step, trainer.Trainer.update
check, finish = trainer.guards.Checks.read, trainer.Trainer.finish


@contextmanager
def synchronisations(device):
    """On a GPU: every call that waits for the device, as CUDA's sync debug mode warns of it."""
    with warnings.catch_warnings(record=True) as synced:
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
            # torch's words for a call that waits; not its note, at first use, that the mode is a prototype
            waits = [w for w in synced if "called a synchronizing CUDA operation" in str(w.message)]
            reads[state["step"]] += len(waits)


def counted_step(self, stop):
    state["step"] = self.step + 1
    reads.setdefault(state["step"], 0)
    with synchronisations(self.device):
        return train_step(self, stop)


def counted_update(self, verdict):
    with synchronisations(self.device):
        return update(self, verdict)


def counted_check(self):
    checked.append(state["step"])
    return check(self)


def report(self, meter):
    params = list(self.raw.parameters())
    kinds = {isinstance(p, DTensor) for p in params}
    try:  # the update torch's default picks on a GPU; a mix of tensors and DTensors fails here
        for p in params:
            p.grad = torch.zeros_like(p)
        torch.optim.AdamW(params, lr=0.0, foreach=True).step()
        foreach = True
    except RuntimeError:
        foreach = False
    self.optimizer.zero_grad(set_to_none=True)
    out = {"reads": reads, "checked": checked, "one_kind": len(kinds) == 1, "foreach": foreach}
    Path(f"reads.rank{self.rank}.json").write_text(json.dumps(out))
    return finish(self, meter)


trainer.Trainer.train_step, trainer.Trainer.update = counted_step, counted_update
trainer.guards.Checks.read, trainer.Trainer.finish = counted_check, report
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
