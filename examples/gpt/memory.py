"""What one process holds: bytes of parameters, gradients and optimizer state, and its peak memory.

Sharded strategies keep DTensors: only the local shard of each is counted, since that is what this process
stores. Tensors that appear twice (the tied embedding and output weight) count once.
"""

import resource
import sys

import torch
from torch.distributed.tensor import DTensor


def local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def nbytes(tensors):
    """Bytes of the distinct tensors among these, their local shards for DTensors."""
    distinct = {id(t): local(t) for t in tensors if isinstance(t, torch.Tensor)}
    return sum(t.numel() * t.element_size() for t in distinct.values())


def optimizers(optimizer):
    """The optimizer and any it wraps: ZeroRedundancyOptimizer keeps its shard's state in an inner one."""
    inner = [v for v in vars(optimizer).values() if isinstance(v, torch.optim.Optimizer)]
    return [optimizer, *inner]


class MemoryMeter:
    """Counts what the model and the optimizer hold. Gradients exist only between backward() and the
    optimizer's zero_grad, so they are counted just before each optimizer step; the largest count stays."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer, self.grads_bytes = model, optimizer, 0
        optimizer.register_step_pre_hook(self._count_grads)

    def parameters(self):
        """The model's parameters (and the optimizer's, where the model is not a module)."""
        params = list(self.model.parameters()) if isinstance(self.model, torch.nn.Module) else []
        return params + [p for group in self.optimizer.param_groups for p in group["params"]]

    def _count_grads(self, *_):
        self.grads_bytes = max(self.grads_bytes, nbytes(p.grad for p in self.parameters()))

    def report(self, device):
        """Bytes held by this process now, and its peak: the device's allocator on a GPU, else peak RSS."""
        params = {id(p): local(p) for p in self.parameters()}
        state = [t for opt in optimizers(self.optimizer) for s in opt.state.values() for t in s.values()]
        if device.type == "cuda":
            peak, peak_kind = torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
        else:  # ru_maxrss: kilobytes on Linux, bytes on macOS
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            peak, peak_kind = rss if sys.platform == "darwin" else rss * 1024, "max_rss"
        return {
            "params": sum(p.numel() for p in params.values()),
            "params_bytes": nbytes(params.values()),
            "grads_bytes": self.grads_bytes,
            "optimizer_bytes": nbytes(state),
            "peak_bytes": peak,
            "peak_kind": peak_kind,
        }
