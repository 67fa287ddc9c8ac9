"""pp: each process keeps its stage's consecutive blocks (split_stage), and Pipeline runs
the train step, the loss and the logits through a torch.distributed.pipelining schedule."""

import itertools
from contextlib import nullcontext

import torch
import torch.distributed as dist
from model import own_stream
from torch.distributed.tensor import DTensor

from parallel.dtensors import local, whole
from parallel.mesh import DATA_DIMS
from parallel.runner import Parallel


def split_stage(model, mesh):
    """pp: keep this stage's share of consecutive blocks. The first stage also embeds, the last
    also holds the final norm and the head, whose weight is the token embedding's: the last stage
    keeps its copy of that matrix under the same name (tok_emb), so snapshots and the optimizer
    name it as one process does."""
    stage, stages = mesh["pp"].get_local_rank(), mesh["pp"].size()
    layers = list(model.blocks)
    mine = layers[stage * len(layers) // stages : (stage + 1) * len(layers) // stages]
    for name in layers:
        if name not in mine:
            del model.blocks[name]
    if stage > 0:
        model.pos_emb = model.dropout = None
        if stage < stages - 1:
            model.tok_emb = None
    if stage < stages - 1:
        model.ln_f = model.head = None
    else:  # the schedule's loss function applies the head (Pipeline): its loss in chunks, as in one process
        model.stop_before_head = True


class Pipeline(Parallel):
    """The pipeline's Parallel: a torch.distributed.pipelining schedule runs forward
    and backward over --pp_microbatches micro-batches; activations go between
    neighbouring stages of mesh["pp"]."""

    def __init__(self, module, layout, mesh, args, device):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        super().__init__(module, module, layout, mesh)
        self.group = mesh["pp"].get_group()
        self.stage, self.stages = mesh["pp"].get_local_rank(), layout.pp
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        self.ranks = [dist.get_global_rank(self.group, i) for i in range(self.stages)]
        self.device = device
        self.tp_rank = mesh["tp"].get_local_rank()
        stage = PipelineStage(module, self.stage, self.stages, device, group=self.group)
        # torch's pipeline has no public hook after a micro-batch's backward: this private method
        # is wrapped, and tests/gpt/test_gpt_layouts.py fails on a torch whose schedule no longer
        # calls it once per micro-batch
        run_backward = stage.backward_maybe_with_nosync

        def backward_then_count(*args, **kwargs):  # memory.MemoryMeter sees each micro-batch's gradients
            out = run_backward(*args, **kwargs)
            self.backward_done()
            return out

        stage.backward_maybe_with_nosync = backward_then_count
        schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.pp_schedule]
        # the last stage's module ends at the final norm: the
        # head and the loss together, in chunks (model.py)
        self.schedule = schedule(stage, args.pp_microbatches, loss_fn=module.head_loss)
        # the first and the last stage each hold a copy of the token embedding, which is also the
        # head: a group per such pair, this process's (None in a middle stage)
        others = itertools.product(*(range(getattr(layout, d)) for d in DATA_DIMS))
        ats = [dict(zip(DATA_DIMS, coords, strict=True)) for coords in others]
        pairs = [[layout.rank(pp=0, **at), layout.rank(pp=self.stages - 1, **at)] for at in ats]
        if dist.get_backend() == "nccl":  # one split of the world's communicator makes them all
            self.tied = dist.split_group(split_ranks=pairs, group_desc="tied embedding")
        else:  # every process creates every group, in the same order
            groups = [(pair, dist.new_group(pair)) for pair in pairs]
            self.tied = next((group for pair, group in groups if dist.get_rank() in pair), None)

    def sync(self, enabled):
        return nullcontext()  # the schedule's micro-batches are the accumulation

    def step(self, x, y, backward):
        """Forward and backward over the micro-batches;
        returns the batch's mean loss in every stage."""
        losses = []
        # dropout: the processes of one share of the batch draw alike, so each stage draws
        # from a stream of its own, as one process's successive blocks draw distinct masks
        with own_stream(self.stage, self.device), self.loss_context():
            if self.first:
                self.schedule.step(x)
            elif self.last:
                self.schedule.step(target=y, losses=losses, return_outputs=False)
            else:
                self.schedule.step()
        # In one process the shared weight's gradient is the sum of its two uses' terms (reading
        # tokens in, scoring them out). Here each use is on its own stage and each copy got one
        # term: adding the two copies' gradients gives both the sum one process has, so both take
        # the same optimizer step and stay equal.
        if self.first or self.last:
            weight = self.module.tok_emb.weight
            # under tp the first stage's lookup leaves its
            # gradient whole (Replicate): cut as the weight is
            if isinstance(weight, DTensor) and weight.grad.placements != weight.placements:
                weight.grad = weight.grad.redistribute(placements=weight.placements)
            dist.all_reduce(local(weight.grad), group=self.tied)
        mean = torch.stack([local(v) for v in losses]).mean() if self.last else None
        return self._from_last(mean, y.device)

    @torch.no_grad()
    def _forward(self, x, shape):
        """Token ids (first stage) through every stage; the last
        stage's output (its final norm's), elsewhere None."""
        if not self.first:
            batch, length = shape
            if self.layout.tp > 1:  # sequence parallel: this process's share of the positions, as Shard(1)
                shares = [len(c) for c in torch.arange(length).chunk(self.layout.tp)] + [0] * self.layout.tp
                length = shares[self.tp_rank]
            x = torch.empty(batch, length, self.module.cfg.n_embd, device=x.device)
            dist.recv(x, self.ranks[self.stage - 1], group=self.group)
        out = self.module(x)
        if not self.last:
            dist.send(out.float().contiguous(), self.ranks[self.stage + 1], group=self.group)
            return None
        return out

    def loss(self, x, y):
        """The mean loss of one batch without a backward pass; every stage gets it."""
        out = self._forward(x, y.shape)
        with self.loss_context():
            loss = None if out is None else local(self.module.head_loss(out, y))
        return self._from_last(loss, y.device)

    def logits(self, idx):
        """The last position's logits (batch, 1, vocab),
        sent from the last stage to every stage."""
        idx, at = self.padded(idx)
        out = self._forward(idx, idx.shape)
        last = torch.empty(idx.shape[0], 1, self.module.cfg.padded_vocab, device=idx.device)
        if out is not None:  # the final norm's output
            last.copy_(whole(self.module.head(out)[:, at : at + 1]).float())
        dist.broadcast(last, self.ranks[-1], group=self.group)
        return last

    def _from_last(self, loss, device):
        loss = torch.zeros((), device=device) if loss is None else loss.detach().float()
        dist.broadcast(loss, self.ranks[-1], group=self.group)
        return loss
