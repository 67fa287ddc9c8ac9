"""Parallel: the model split as the layout says, behind the one interface the trainer runs
for every layout (a pipeline's is pipeline_parallel.Pipeline)."""

from contextlib import nullcontext

import torch
from model import generate
from torch.nn.parallel import DistributedDataParallel as DDP

from parallel.dtensors import local, whole


class Parallel:
    """What the trainer runs: the model split as the layout says, behind one interface for
    every layout. module: this process's part of the GPT (its state dict is the snapshot's);
    step(): forward and backward of one micro-batch; loss() and logits(): forward only, for
    evaluation and the sample at the end."""

    def __init__(self, module, runner, layout, mesh):
        self.module, self.runner, self.layout, self.mesh = module, runner, layout, mesh
        self.after_backward = []  # called after each micro-batch's backward (memory.MemoryMeter)
        self.forward_timer = nullcontext()  # around each forward pass (metrics.RankTimes)

    def train(self, mode=True):
        self.module.train(mode)

    def sync(self, enabled):
        """A context for backward(): with enabled=False, gradients add up locally without
        communication (DDP's no_sync); the last micro-batch's backward reduces them. FSDP2
        reduce-scatters every micro-batch's gradients all the same (as torchtitan does), so
        that they stay sharded: 1/dp_shard of the model's at their peak, not a whole
        float32 copy kept between micro-batches. Only HSDP's all-reduce across the replicas
        waits for the last micro-batch."""
        if hasattr(self.module, "set_requires_all_reduce"):  # an FSDP module
            self.module.set_requires_all_reduce(enabled)
        elif isinstance(self.runner, DDP) and not enabled:
            return self.runner.no_sync()
        return nullcontext()

    def loss_context(self):
        """Under tp the head's logits stay split over the vocabulary: the loss, and
        its backward, are then computed on the split (torch's loss_parallel)."""
        if self.layout.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return nullcontext()

    def step(self, x, y, backward):
        with self.loss_context():
            with self.forward_timer:
                _, loss = self.runner(x, y)
            backward(loss)
        self.backward_done()
        return local(loss.detach())

    def backward_done(self):
        for hook in self.after_backward:
            hook()

    def loss(self, x, y):
        with self.loss_context():
            return local(self.module(x, y)[1])

    def logits(self, idx):
        """The last position's logits (batch, 1, vocab), whole."""
        idx, last = self.padded(idx)
        return whole(self.module(idx)[:, last : last + 1])

    def padded(self, idx):
        """(idx padded on the right to a multiple of tp, the last real position): sequence
        parallel splits the positions evenly, and causal attention keeps the padding out
        of the positions before it."""
        length = idx.shape[1]
        extra = -length % self.layout.tp
        return torch.cat([idx, idx[:, -1:].expand(-1, extra)], dim=1), length - 1

    def generate(self, idx, count, **kwargs):
        return generate(self.logits, idx, count, self.module.cfg.block_size, **kwargs)
