"""tp: every block's four matrices, both embeddings and the head split over mesh["tp"],
with sequence parallel between them, as torchtitan plans it."""

from model import own_stream
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def apply_tp(model, mesh):
    """tp, as torchtitan plans it: every parameter becomes a DTensor on mesh["tp"], so that AdamW
    (fused or foreach), clipping and the checks see one kind of tensor. Split: both embeddings by
    rows (a process looks up its share of the vocabulary, or of the positions, and one
    reduce-scatter sums the parts), qkv and fc by output columns (whole heads: model.py lays qkv
    out head by head), both proj by input rows, and the head by the vocabulary: its logits stay
    split and the loss is computed on the split (torch's loss_parallel), so no process holds the
    whole (batch, length, vocabulary) logits. Between the matrices the activations are split along
    the sequence (sequence parallel): the norms (replicated weights), the residual stream and its
    dropout hold 1/tp of the positions; all-gathered before qkv and fc. Each process's dropout
    draws its own masks: its share of the positions (ShareDropout) or of the heads
    (model.CausalSelfAttention.attend)."""
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    tp, rank = mesh["tp"], mesh["tp"].get_local_rank()
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    block_plan = {
        "ln1": SequenceParallel(),
        "attn": gather,
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
        "ln2": SequenceParallel(),
        "mlp": gather,
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    for block in model.blocks.values():
        parallelize_module(block, tp, present(block, block_plan))
        block.attn.head_share = rank
    root_plan = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "pos_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "ln_f": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    parallelize_module(model, tp, present(model, root_plan))
    model.loss_chunk = None  # the loss on the logits split over the vocabulary (loss_parallel), not in chunks
    if model.head is not None and model.tok_emb is not None:
        model.head.weight = model.tok_emb.weight  # both split by the vocabulary, alike: one matrix again
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is nn.Dropout:
                setattr(module, name, ShareDropout(child.p, rank))


def present(module, plan):
    """The entries of a tensor-parallel plan whose modules this module has
    (a pipeline stage lacks some; a model of your own may lack a norm)."""
    out = {}
    for name, style in plan.items():
        try:
            found = module.get_submodule(name)
        except AttributeError:
            found = None
        if found is not None:
            out[name] = style
    return out


class ShareDropout(nn.Dropout):
    """Dropout over one process's share of the positions (sequence parallel): the processes of one
    batch share a random stream, so each draws from its own, seeded from the shared one, as one
    process draws distinct masks for distinct positions."""

    def __init__(self, p, share):
        super().__init__(p)
        self.share = share

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        with own_stream(self.share, x.device):
            return super().forward(x)
