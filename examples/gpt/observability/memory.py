"""What one process holds: bytes of parameters, gradients and optimizer state, and its peak memory.

Sharded strategies keep DTensors: only the local shard of each is counted, since that is what this
process stores. Tensors that appear twice (the tied embedding and output weight) count once.
Gradients are counted at the end of every micro-batch's backward, where they peak: FSDP2 may then
hold unsharded gradients of its own (gradient sync off, as a pipeline stage does between its
micro-batches), which are counted too.
"""

import re
import resource

import torch
from processes import all_ranks
from torch.distributed.tensor import DTensor


def local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def nbytes(tensors):
    """Bytes of the distinct tensors among these, their local shards for DTensors."""
    distinct = {id(t): local(t) for t in tensors if isinstance(t, torch.Tensor)}
    return sum(t.numel() * t.element_size() for t in distinct.values())


def optimizers(optimizer):
    """The optimizer and any it wraps: ZeroRedundancyOptimizer
    keeps its shard's state in an inner one."""
    inner = [v for v in vars(optimizer).values() if isinstance(v, torch.optim.Optimizer)]
    return [optimizer, *inner]


def fsdp_unsharded_grads(model):
    """The whole-size gradients FSDP2 keeps between micro-batches while its gradient sync is off
    (not parameters' .grad: they wait inside FSDP's own parameter records until a
    reduce-scatter)."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for module in model.modules() if isinstance(model, torch.nn.Module) else []:
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for param in group.fsdp_params:
                unsharded = getattr(param, "_unsharded_param", None)
                out += [param.unsharded_accumulated_grad, None if unsharded is None else unsharded.grad]
    return out


class MemoryMeter:
    """Counts what the model and the optimizer hold. Gradients exist only between backward() and
    the optimizer's zero_grad: they are counted after each micro-batch's backward (count_grads,
    which the trainer's Parallel calls when given as `parallel`) and just before each optimizer
    step; the largest count stays."""

    def __init__(self, model, optimizer, parallel=None):
        self.model, self.optimizer, self.grads_bytes = model, optimizer, 0
        self.active = True  # the trainer counts on the steps that log only: every step holds the same
        optimizer.register_step_pre_hook(self.count_grads)
        if parallel is not None:
            parallel.after_backward.append(self.count_grads)

    def parameters(self):
        """The model's parameters (and the optimizer's, where the model is not a module)."""
        params = list(self.model.parameters()) if isinstance(self.model, torch.nn.Module) else []
        return params + [p for group in self.optimizer.param_groups for p in group["params"]]

    def count_grads(self, *_):
        if not self.active:
            return
        held = [p.grad for p in self.parameters()] + fsdp_unsharded_grads(self.model)
        self.grads_bytes = max(self.grads_bytes, nbytes(held))

    def report(self, device):
        """Bytes held by this process now, and its peak:
        the device's allocator on a GPU, else peak RSS."""
        params = {id(p): local(p) for p in self.parameters()}
        state = [t for opt in optimizers(self.optimizer) for s in opt.state.values() for t in s.values()]
        if device.type == "cuda":
            peak, peak_kind = torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
        else:
            peak, peak_kind = max_rss(), "max_rss"
        return {
            "params": sum(p.numel() for p in params.values()),
            "params_bytes": nbytes(params.values()),
            "grads_bytes": self.grads_bytes,
            "optimizer_bytes": nbytes(state),
            "peak_bytes": peak,
            "peak_kind": peak_kind,
        }


class MemoryHistory:
    """--memory_snapshot FILE, on a GPU: every CUDA allocation and free from the start, with its
    stack, written to FILE at the end of training (or when it stops), for pytorch.org/memory_viz.
    The names are the ones torch's CUDA memory documentation gives, underscored in torch itself.
    Not yet run on a GPU here."""

    def __init__(self, path, device, entries=100_000):
        self.path = path if device.type == "cuda" else None
        if self.path:
            torch.cuda.memory._record_memory_history(max_entries=entries)

    def dump(self):
        if self.path:
            torch.cuda.memory._dump_snapshot(self.path)
            torch.cuda.memory._record_memory_history(enabled=None)


def report(meter, device, metrics, step):
    """A collective: every process's memory (meter.report) as one metrics record each, at `step`,
    and a log line of the largest of each kind."""
    memory = all_ranks(meter.report(device))
    for rank, fields in enumerate(memory):
        scalars = {f"memory/{k}/rank{rank}": v for k, v in fields.items() if k.endswith("_bytes")}
        metrics.record(step, scalars, memory=fields, rank=rank)
    most = {key: max(m[key] for m in memory) / 2**20 for key in memory[0] if key.endswith("_bytes")}
    metrics.log(
        "memory per rank, MiB, the largest: params {params_bytes:.2f} | grads {grads_bytes:.2f} | "
        "optimizer state {optimizer_bytes:.2f} | peak {peak_bytes:.0f}".format(**most)
        + f" ({memory[0]['peak_kind']})"
    )


def max_rss():
    """This process's peak resident memory in bytes. On Linux VmHWM, its own: ru_maxrss also holds
    the peak of the process that started it (a process started by vfork and exec keeps its
    parent's), so torchrun's workers would report torchrun's, or their caller's."""
    try:
        with open("/proc/self/status") as status:
            return int(re.search(r"^VmHWM:\s+(\d+) kB$", status.read(), re.M).group(1)) * 1024
    except (OSError, AttributeError):  # not Linux: ru_maxrss, in bytes on macOS
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
