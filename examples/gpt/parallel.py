"""How the processes share the work, chosen by --parallel: one small function per strategy.

Each function takes the plain model and returns what the trainer runs forward and backward on. Read them
side by side: the delta from DDP is the lesson. Below them, what the trainer needs where a strategy splits
one model between processes: its share of each batch, the gradient norm, whole snapshots.
"""

from contextlib import nullcontext

import torch
import torch.distributed as dist
from model import GPT, cross_entropy, optimizer_groups
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP


def ddp(model, args, device):
    """A full replica in every process; backward() averages the gradients over all of them."""
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if args.comm_hook:  # each gradient bucket travels in 16 bits and is cast back to float32
        model.register_comm_hook(None, getattr(default_hooks, f"{args.comm_hook}_compress_hook"))
    return model


def zero(model, args, device):
    """DDP as it is; the difference is the optimizer (make_optimizer): each process keeps the AdamW state
    of its share of the parameters only, updates that share, and broadcasts it to the others."""
    return ddp(model, args, device)


def fsdp(model, args, device):
    """Every parameter split in equal parts over the processes (FSDP2). Each block gathers its weights
    just before its forward and backward and drops them after; gradients are reduce-scattered, so each
    process keeps the gradient and AdamW state of its part alone. The tied embedding/output matrix
    belongs to no block: the root call shards it, once."""
    from config import resolve_dtype  # here: config reads this module's names when it is imported
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # a second or two to import

    # bf16: weights gathered and computed in bfloat16, gradients reduced in float32 into float32 shards,
    # which AdamW updates (the master weights); otherwise everything travels in float32
    policy = MixedPrecisionPolicy()
    if resolve_dtype(args.dtype, device) == torch.bfloat16:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    raw = getattr(model, "_orig_mod", model)  # under torch.compile, shard the module it wraps
    for block in raw.blocks.values():
        fully_shard(block, mp_policy=policy)
    fully_shard(raw, mp_policy=policy)
    return model


def tp(model, args, device):
    """Every block's four matrices split over all processes, which read the same batch. Column-split
    (qkv, fc): each process computes its share of the outputs (whole heads, since model.py lays qkv out head
    by head); row-split (proj): each multiplies its share of the inputs and one all-reduce adds the parts.
    Two all-reduces per block forward, two backward; embeddings, norms and the head stay whole everywhere."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    plan = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel()}
    plan |= {"mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
    for block in model.blocks.values():
        parallelize_module(block, mesh, plan)
    return model


def pp(model, args, device):
    """Consecutive blocks per process, a pipeline stage each: the first also embeds, the last also holds
    the final norm and the head. Each process drops the rest of the model; --pp_microbatches micro-batches
    flow through the stages, scheduled by --pp_schedule."""
    rank, world = dist.get_rank(), dist.get_world_size()
    layers = list(model.blocks)
    mine = layers[rank * len(layers) // world : (rank + 1) * len(layers) // world]
    for name in layers:
        if name not in mine:
            del model.blocks[name]
    if rank > 0:
        model.tok_emb = model.pos_emb = None
    if rank < world - 1:
        model.ln_f = model.head = None
    stage = PipelineStage(Layers(model), rank, world, device)
    schedule = SCHEDULES[args.pp_schedule](stage, args.pp_microbatches, loss_fn=cross_entropy)
    return Pipeline(model, schedule)


STRATEGIES = {"ddp": ddp, "zero": zero, "fsdp": fsdp, "tp": tp, "pp": pp}
SHARDED_SNAPSHOTS = {"fsdp"}  # their snapshots are directories of shards (checkpoint.save_sharded)
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}  # --pp_schedule
SPLIT_MODEL = ("tp", "pp")  # the strategies whose processes hold parts of one model and read one batch


def parallelize(model, args, device):
    """The model wrapped by the strategy of --parallel; unchanged in a single process. tp and pp change the
    model in place: build the optimizer after this."""
    if not dist.is_initialized():
        return model
    return STRATEGIES[args.parallel](model, args, device)


def split_model(args):
    return args.parallel in SPLIT_MODEL and dist.is_initialized()


def data_parallel_layout(args, rank, world):
    """(this process's share, number of shares) of each global batch: every process has its own share
    under data parallelism; processes that split one model between them share one."""
    return (0, 1) if args.parallel in SPLIT_MODEL else (rank, world)


def make_optimizer(groups, args, device):
    """AdamW over the parameter groups; under --parallel zero, split over the processes by whole tensors.
    Built after parallelize(): FSDP replaces the parameters by their shards."""
    options = dict(lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    if args.parallel == "zero" and dist.is_initialized():
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, torch.optim.AdamW, **options)
    return torch.optim.AdamW(groups, **options)


def full_optimizer_state(optimizer):
    """The whole optimizer state_dict in process 0 (None in the others under --parallel zero, whose
    shares are first gathered there); a collective under zero."""
    if hasattr(optimizer, "consolidate_state_dict"):  # a ZeroRedundancyOptimizer
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if dist.get_rank() == 0 else None
    return optimizer.state_dict()


def gradient_sync(model, enabled):
    """A context for backward(): with enabled=False, gradients add up locally without communication
    (DDP's no_sync, FSDP's set_requires_gradient_sync); the last micro-batch's backward reduces them."""
    inner = getattr(model, "_orig_mod", model)
    if hasattr(inner, "set_requires_gradient_sync"):  # an FSDP module
        inner.set_requires_gradient_sync(enabled)
    elif isinstance(model, DDP) and not enabled:
        return model.no_sync()
    return nullcontext()


# ---- pp: the train step and the validation loss ---------------------------------------------------------
class Layers(nn.Module):
    """A pipeline stage's module: what it receives in, what it sends on (GPT.layers)."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, x):
        return self.gpt.layers(x)


class Pipeline:
    """What the trainer runs under pp in place of model(x, y) and backward()."""

    def __init__(self, stage_model, schedule):
        self.model, self.schedule = stage_model, schedule
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.first, self.last = self.rank == 0, self.rank == self.world - 1
        # the first and the last stage each hold a copy of the token embedding, which is also the head
        self.tied = dist.new_group([0, self.world - 1])

    def train(self, mode=True):
        self.model.train(mode)

    def eval(self):
        self.model.train(False)

    def step(self, x, y):
        """Forward and backward over the micro-batches; returns the batch's mean loss in every process."""
        losses = []
        if self.first:
            self.schedule.step(x)
        elif self.last:
            self.schedule.step(target=y, losses=losses, return_outputs=False)
        else:
            self.schedule.step()
        # In one process the shared weight's gradient is the sum of its two uses' terms (reading tokens in,
        # scoring them out). Here each use is on its own stage and each copy got one term: adding the two
        # copies' gradients gives both the sum one process has, so both take the same optimizer step and
        # stay equal.
        if self.first or self.last:
            weight = self.model.tok_emb.weight if self.first else self.model.head.weight
            dist.all_reduce(weight.grad, group=self.tied)
        return self._from_last(torch.stack(losses).mean() if self.last else None, y.device)

    @torch.no_grad()
    def loss(self, x, y):
        """The mean loss of one batch without a backward pass: the activations go from stage to stage
        whole; every process gets the loss."""
        if not self.first:
            x = torch.empty(*y.shape, self.model.cfg.n_embd, device=y.device)
            dist.recv(x, self.rank - 1)
        out = self.model.layers(x)
        if not self.last:
            dist.send(out.float().contiguous(), self.rank + 1)
        return self._from_last(cross_entropy(out, y) if self.last else None, y.device)

    def _from_last(self, loss, device):
        loss = torch.zeros((), device=device) if loss is None else loss.detach().float()
        dist.broadcast(loss, self.world - 1)
        return loss


# ---- the gradient norm and whole snapshots where processes hold parts of one model ----------------------
def _local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _split(param):
    """True for a tensor-parallel matrix or bias cut into parts, one per process."""
    return isinstance(param, DTensor) and any(isinstance(p, Shard) for p in param.placements)


def clip_grad_norm_(model, max_norm, args):
    """torch.nn.utils.clip_grad_norm_ over the whole model, wherever its parts live. Under tp and pp the
    squares of what each process alone holds are summed over the processes; a copy that several hold (tp:
    embeddings, norms, row-split biases; pp: the last stage's copy of the token embedding) counts once."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not split_model(args):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    if args.parallel == "tp":
        own, copies = [p for p in params if _split(p)], [p for p in params if not _split(p)]
    else:  # pp: the last stage's copy of the token embedding is the first stage's to count
        tie = model.head.weight if model.head is not None and model.tok_emb is None else None
        own, copies = [p for p in params if p is not tie], []
    squares = [_local(p.grad).float().pow(2).sum() for p in own]
    total = torch.stack(squares).sum() if squares else torch.zeros((), device=params[0].device)
    dist.all_reduce(total)
    for p in copies:
        total += _local(p.grad).float().pow(2).sum()
    norm = total.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # as torch's, so one process gets the same numbers
    for p in params:
        _local(p.grad).mul_(scale)
    return norm


def replicas(model, args):
    """(what, tensors): the parameters every process that holds them must end with bit for bit; none
    under fsdp, where no two processes hold the same part (gathering them would prove nothing)."""
    if args.parallel == "fsdp" and dist.is_initialized():
        return "fsdp shards every parameter: no replicas to compare", []
    if not split_model(args):
        return "final weights", list(model.parameters())
    if args.parallel == "tp":
        return "final unsplit weights", [_local(p) for p in model.parameters() if not _split(p)]
    ends = [
        m.weight for m in (model.tok_emb, model.head) if m is not None
    ]  # pp: the first and the last stage
    return "final token embedding (also the head)", ends


def _whole_order(cfg):
    """Parameter names in the order a single process's optimizer numbers them (no memory: meta tensors)."""
    with torch.device("meta"):
        whole = GPT(cfg)
    names = {id(p): name for name, p in whole.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in optimizer_groups(whole, 0.0)]


def _whole_name(name):
    return "tok_emb.weight" if name == "head.weight" else name  # pp's last stage holds the tie as head


def whole_state(model, optimizer):
    """Collective. On rank 0, the model's and the optimizer's state dicts exactly as one process training
    the whole model would have them (so every strategy resumes from them); None elsewhere."""

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()

    model_state = {name: full(t) for name, t in model.state_dict().items()}
    groups = _whole_order(model.cfg)
    index = {name: i for i, name in enumerate(n for group in groups for n in group)}
    names = {id(p): name for name, p in model.named_parameters()}
    opt_state = {
        index[_whole_name(names[id(p)])]: {key: full(value) for key, value in optimizer.state[p].items()}
        for group in optimizer.param_groups
        for p in group["params"]
        if p in optimizer.state
    }
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((model_state, opt_state), parts)
    if parts is None:
        return None
    model_state, opt_state = {}, {}
    for m, o in parts:
        model_state |= m
        opt_state |= o
    param_groups = optimizer.state_dict()["param_groups"]
    start = 0
    for group, names_in_group in zip(param_groups, groups, strict=True):
        group["params"] = list(range(start, start + len(names_in_group)))
        start += len(names_in_group)
    return model_state, {"state": opt_state, "param_groups": param_groups}


def load_whole_state(model, optimizer, model_state, opt_state):
    """whole_state's inverse: every process takes its parts of a whole model's state dicts."""

    def part(full, like):
        if not isinstance(like, DTensor):
            return full
        return distribute_tensor(full.to(like.device), like.device_mesh, like.placements)

    model.load_state_dict({name: part(model_state[name], t) for name, t in model.state_dict().items()})
    groups = _whole_order(model.cfg)
    index = {name: i for i, name in enumerate(n for group in groups for n in group)}
    names = {id(p): name for name, p in model.named_parameters()}
    mine = optimizer.state_dict()
    mine["state"] = {}
    for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        saved = opt_state["state"].get(index[_whole_name(names[id(p)])])
        if saved is not None:
            mine["state"][i] = {key: part(value, p) if value.dim() else value for key, value in saved.items()}
    for group, saved in zip(mine["param_groups"], opt_state["param_groups"], strict=True):
        group |= {key: value for key, value in saved.items() if key != "params"}
    optimizer.load_state_dict(mine)
