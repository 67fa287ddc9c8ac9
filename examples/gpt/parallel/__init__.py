"""How the processes share the work: one device mesh (Layout) and a small function per parallelism.

    apply_ac        activation checkpointing of the chosen blocks (ac.py), before any of these
    build_mesh      the named mesh pp x dp_replicate x dp_shard x tp
    split_stage     pp: this process keeps its stage's consecutive blocks
    apply_tp        tp: every block's four matrices split over mesh["tp"]
    apply_compile   --compile: each block's forward compiled, after tp and before FSDP
    apply_fsdp      dp_shard (and HSDP's replicas): parameters, gradients, AdamW state sharded (FSDP2)
    apply_ddp       dp_replicate alone: a replica per process, gradients all-reduced (DDP)
    make_optimizer  AdamW, or under zero the ZeroRedundancyOptimizer over the replicas

parallelize() applies the ones the layout asks for, in that order, to a model built on the meta
device, then gives each process's part its initial values (materialise). Each function is
short: read them side by side with docs/parallelism.md. Below them, what the trainer needs
wherever a model is split: the step and the loss of a pipeline, the gradient norm, and the
end-of-run comparison of replicas.
"""

import hashlib
import itertools
import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from ac import apply_ac
from model import generate, init_buffers, initial_value, own_stream
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP

DATA_DIMS = ("dp_replicate", "dp_shard", "tp")  # the dimensions inside one pipeline stage
# --parallel NAME: the one-dimensional layout it stands for, all processes along one mesh dimension
SHORTHAND = {"ddp": "dp_replicate", "zero": "dp_replicate", "fsdp": "dp_shard", "tp": "tp", "pp": "pp"}
SCHEDULES = ("gpipe", "1f1b")  # --pp_schedule


@dataclass(frozen=True)
class Layout:
    """How the processes share the work: a device mesh of four named dimensions, outermost first
    (as torchtitan orders them, so that tp's processes are neighbours, on one node): pipeline
    stages (pp), then replicas (dp_replicate: DDP, or HSDP's replicas), then shards of the
    data-parallel state (dp_shard: FSDP), then tensor-parallel parts of each matrix (tp). Rank r
    sits at the coordinates r has written in mixed radix (pp, dp_replicate, dp_shard, tp). The
    data-parallel processes (dp_replicate x dp_shard of them) each read their own share of a batch;
    the pp and tp processes of one share read the same one."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    zero: bool = False  # dp_replicate's AdamW state split over the replicas (ZeroRedundancyOptimizer)

    NAMES = ("pp", "dp_replicate", "dp_shard", "tp")
    # The process that logs, writes the metrics file and commits each snapshot (its extra state and
    # the pointer to it): the one at coordinate 0 of every dimension, on the first pipeline stage.
    leader = 0

    @property
    def shape(self):
        return tuple(getattr(self, name) for name in self.NAMES)

    @property
    def world(self):
        return math.prod(self.shape)

    @property
    def dp(self):
        """Data-parallel shares of each global batch."""
        return self.dp_replicate * self.dp_shard

    def coords(self, rank):
        """{dimension: this rank's index along it}."""
        out = {}
        for name, size in zip(reversed(self.NAMES), reversed(self.shape), strict=True):
            rank, out[name] = divmod(rank, size)
        return {name: out[name] for name in self.NAMES}

    def rank(self, **coords):
        rank = 0
        for name, size in zip(self.NAMES, self.shape, strict=True):
            rank = rank * size + coords.get(name, 0)
        return rank

    def dp_rank(self, rank):
        """Which share of each global batch this rank reads."""
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def describe(self):
        parts = [f"{name} {size}" for name, size in zip(self.NAMES, self.shape, strict=True) if size > 1]
        return (" x ".join(parts) or "one process") + (" (zero)" if self.zero else "")

    def as_dict(self):
        return {name: getattr(self, name) for name in (*self.NAMES, "zero")}


def make_layout(args, world):
    """The Layout of these arguments for `world` processes; ValueError (one line) when they cannot
    make one. Degrees not given are 1; --parallel NAME puts every process along NAME's dimension
    (the command line's reader makes it ddp when neither it nor a degree is given)."""
    given = {name: getattr(args, name) for name in Layout.NAMES if getattr(args, name) is not None}
    zero = args.parallel == "zero"
    if zero and any(given.get(name, 1) != 1 for name in ("dp_shard", "tp", "pp")):
        raise ValueError(
            "--parallel zero splits AdamW's state over plain replicas (--dp_replicate); with --dp_shard, "
            "--tp or --pp the state is already split, or belongs to one stage: leave zero out"
        )
    if args.parallel is not None:
        dim = SHORTHAND[args.parallel]
        if args.comm_hook and dim != "dp_replicate":
            raise ValueError(comm_hook_refused(f"--parallel {args.parallel}"))
        if dim == "pp" and world == 1:
            raise ValueError(
                "--parallel pp needs at least 2 processes, one pipeline stage each (WORLD_SIZE is 1): "
                "start it with torchrun --nproc-per-node 2 or more"
            )
        if given and not zero:
            raise ValueError(
                f"--parallel {args.parallel} is shorthand for --{dim} {world} (WORLD_SIZE): give either it "
                f"or the degrees ({', '.join(f'--{name}' for name in given)})"
            )
        given = {dim: given.get(dim, world)}
    if any(size <= 0 for size in given.values()):
        bad = next(name for name, size in given.items() if size <= 0)
        raise ValueError(f"--{bad} must be positive, got {given[bad]}")
    layout = Layout(**given, zero=zero)
    if layout.world != world:
        product = " x ".join(f"--{name} {getattr(layout, name)}" for name in Layout.NAMES)
        raise ValueError(
            f"{product} = {layout.world} processes, but WORLD_SIZE is {world}: the product of the degrees "
            "must be the number of processes"
        )
    return layout


def comm_hook_refused(layout):
    return f"--comm_hook is for DDP: it compresses DDP's gradient all-reduce, which {layout} does not run"


def native_bf16():
    """bfloat16 in hardware (compute capability 8.0 on):
    is_bf16_supported() alone counts emulation too."""
    return torch.cuda.is_bf16_supported(including_emulation=False)


def resolve_dtype(name, device):
    """--dtype as a torch dtype: auto is bfloat16 on
    GPUs that have it, else float16; float32 on CPUs."""
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if native_bf16() else torch.float16
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def layout_checks(args, layout, cuda):
    """Sizes that do not split over the layout, found here, before
    any process group forms: the first refusal, or None."""
    checks = [
        (
            args.n_head % layout.tp == 0,
            f"--tp {layout.tp}: --n_head {args.n_head} does not divide into {layout.tp} parts",
        ),
        (
            args.block_size % layout.tp == 0,
            f"--tp {layout.tp}: --block_size {args.block_size} does not divide into {layout.tp} parts "
            "(sequence parallel splits the positions)",
        ),
        (
            not args.comm_hook or (layout.pp, layout.dp_shard, layout.tp) == (1, 1, 1),
            comm_hook_refused(layout.describe()),
        ),
        (
            not args.compile or layout.tp == 1 or args.dropout == 0,
            f"--compile with --tp {layout.tp} and --dropout {args.dropout}: each process draws its share's "
            "dropout masks from a random stream of its own, which torch.compile cannot trace: --dropout 0, "
            "or no --compile",
        ),
    ]
    if layout.pp > 1:
        checks += [
            (
                layout.pp <= args.n_layer,
                f"--pp {layout.pp} pipeline stages but only {args.n_layer} layers (--n_layer): at least "
                "one block per stage",
            ),
            (
                args.pp_microbatches <= 0 or args.batch_size % args.pp_microbatches == 0,
                f"--pp {layout.pp}: --pp_microbatches {args.pp_microbatches} does not divide --batch_size "
                f"{args.batch_size}",
            ),
            (
                args.pp_schedule != "1f1b" or args.pp_microbatches >= layout.pp,
                f"--pp {layout.pp}: --pp_schedule 1f1b needs at least one micro-batch per stage: "
                f"--pp_microbatches {args.pp_microbatches} for {layout.pp} stages",
            ),
            (
                resolve_dtype(args.dtype, torch.device("cuda" if cuda else "cpu")) != torch.float16,
                f"--pp {layout.pp}: --dtype fp16 (auto's choice on GPUs without bf16) needs a gradient "
                "scaler, which the pipeline lacks here: pass --dtype fp32 or bf16",
            ),
        ]
    return next((message for ok, message in checks if not ok), None)


def build_mesh(layout, device):
    """The named device mesh, outermost dimension first; dimensions
    of size 1 are kept, so every name exists in every layout."""
    return init_device_mesh(device.type, layout.shape, mesh_dim_names=layout.NAMES)


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


def apply_compile(model, mode="default"):
    """--compile: each block's forward compiled in place, as torchtitan compiles each block,
    after tp and before FSDP. fullgraph: a graph break is an error, never a block run eagerly.
    The blocks share their code, so one compiled graph serves them all. The forward, not the
    module (block.compile() would trace its hooks): FSDP's all-gathers, which dynamo never
    traces, run around the graph; and the parameters keep their names, so snapshots load
    across compiled and eager runs."""
    for block in model.blocks.values():
        block.forward = torch.compile(block.forward, fullgraph=True, mode=mode)


def apply_fsdp(model, mesh, param_dtype=None, reshard_after_forward=True):
    """FSDP2 over (dp_replicate, dp_shard): each block's parameters split over dp_shard, gathered
    just before its forward and backward, gradients reduce-scattered; with dp_replicate > 1, HSDP:
    the shards are replicated and their gradients all-reduced across replicas. Under bf16,
    parameters travel in bf16 (the norms upcast them), gradients are reduced in float32 and the
    float32 shards are the master copy. The tied embedding/head matrix belongs to no block: the
    root call shards it, once. A pipeline stage passes reshard_after_forward=False (torchtitan's
    policy under pp): each block stays gathered from its first micro-batch's forward to the step's
    last backward, one all-gather per block and step instead of one per micro-batch and pass."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # costs a second or two to import

    # the blocks' inputs are not cast: the residual stream
    # stays float32, as one process's under autocast
    policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    dp_mesh = mesh["dp_replicate", "dp_shard"]
    blocks = list(model.blocks.values())
    for block in blocks:
        # the last block stays gathered after forward: backward starts with it
        reshard = reshard_after_forward and block is not blocks[-1]
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)


def apply_ddp(module, mesh, device, comm_hook=None):
    """DDP over dp_replicate: a whole replica (or pipeline stage) per process; backward()
    averages the gradients over the replicas, optionally in 16 bits on the wire."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    group = mesh["dp_replicate"].get_group()
    ids = [device.index] if device.type == "cuda" else None
    # gradients are views into DDP's buckets: no copy
    # into them before each all-reduce, nor the memory
    module = DDP(module, device_ids=ids, process_group=group, gradient_as_bucket_view=True)
    if comm_hook:  # each gradient bucket travels in 16 bits and is cast back to float32
        module.register_comm_hook(group, getattr(default_hooks, f"{comm_hook}_compress_hook"))
    return module


def make_optimizer(groups, layout, mesh, device):
    """AdamW over the parameter groups, built after the model is split (FSDP and tp replace
    parameters); under zero, each replica keeps and updates the AdamW state of its share of the
    tensors only, then broadcasts the updated share."""
    # fused on every device: the GPU's kernel runs on the CPU too, so the tests run the GPU's path;
    # it also skips a step on the device (found_inf, trainer.update). lr: set before every step
    options = dict(lr=1.0, betas=(0.9, 0.95), fused=True)
    if layout.zero and layout.dp_replicate > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        group = mesh["dp_replicate"].get_group()
        # bucket views: each process's updated share is
        # broadcast as a few flat buffers, not a tensor each
        return ZeroRedundancyOptimizer(
            groups, torch.optim.AdamW, process_group=group, parameters_as_bucket_view=True, **options
        )
    return torch.optim.AdamW(groups, **options)


def local_optimizer(optimizer):
    """The optimizer that holds this process's state:
    ZeroRedundancyOptimizer keeps its share in .optim."""
    return getattr(optimizer, "optim", optimizer)


def materialise(model, device, seed):
    """Storage for this process's parts (the model was built on the meta device), filled with
    their initial values: each parameter is made whole on the CPU, one at a time, cut there
    (local_part), and only this process's part is copied to the device; buffers as their
    modules fill them (init_buffers)."""
    model.to_empty(device=device)
    if model.head is not None and model.tok_emb is not None:
        model.head.weight = model.tok_emb.weight  # to_empty gives each module its own tensor
    init_buffers(model)
    cpu_meshes = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = initial_value(name, param.shape, model.cfg, seed)
            local(param).copy_(local_part(value, param, cpu_meshes))
            del value  # the next whole parameter is made once this one is gone


def local_part(value, param, cpu_meshes):
    """This process's part of the whole CPU tensor `value` of a (DTensor) parameter, cut on the
    CPU as distribute_tensor cuts it (which would first copy the whole tensor to the
    parameter's device): on a CPU mesh of the same ranks, without process groups, and
    src_data_rank=None, so nothing is sent."""
    if not isinstance(param, DTensor):
        return value
    mesh = param.device_mesh
    if id(mesh) not in cpu_meshes:
        names = mesh.mesh_dim_names
        cpu_meshes[id(mesh)] = DeviceMesh("cpu", mesh.mesh, mesh_dim_names=names, _init_backend=False)
    return distribute_tensor(value, cpu_meshes[id(mesh)], param.placements, src_data_rank=None).to_local()


def local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def whole(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


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


def parallelize(model, layout, args, device, param_dtype=None):
    """The meta-device model split over the layout, materialised: a Parallel (or Pipeline), or in a
    single process the plain model behind the same interface. Activation checkpointing (--ac) is
    set on the blocks first, whatever the layout."""
    apply_ac(model, args.ac, args.ac_every)
    if layout.world == 1:
        if args.compile:
            apply_compile(model, args.compile_mode)
        materialise(model, device, args.seed)
        return Parallel(model, model, layout, None)
    mesh = build_mesh(layout, device)
    if layout.pp > 1:
        split_stage(model, mesh)
    if layout.tp > 1:
        apply_tp(model, mesh)
    if args.compile:
        apply_compile(model, args.compile_mode)
    # replicas beside tp or pp are HSDP's (FSDP2 with dp_shard 1):
    # DDP takes no DTensors, nor a pipeline schedule's micro-batches
    sharded = layout.dp_shard > 1 or (layout.dp_replicate > 1 and (layout.tp > 1 or layout.pp > 1))
    if sharded:
        apply_fsdp(model, mesh, param_dtype, reshard_after_forward=layout.pp == 1)
    materialise(model, device, args.seed)
    if layout.pp > 1:
        return Pipeline(model, layout, mesh, args, device)
    runner = model
    if layout.dp_replicate > 1 and not sharded:
        runner = apply_ddp(runner, mesh, device, args.comm_hook)
    return Parallel(model, runner, layout, mesh)


# ---- pp: the train step, the loss and the logits
# ----------------------------------------------------------
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


# ---- the gradient norm and the replicas, wherever the
# parts live -----------------------------------------
def sharded_dims(tensor):
    """The mesh dimensions a DTensor is split along (FSDP's dp_shard, tp's), by name."""
    if not isinstance(tensor, DTensor):
        return ()
    names = tensor.device_mesh.mesh_dim_names
    return tuple(n for n, p in zip(names, tensor.placements, strict=True) if not isinstance(p, Replicate))


def counted_once(parallel):
    """The parameters whose squares enter the gradient norm here: all, but the
    last stage's copy of the tied embedding (the first stage counts it)."""
    params = [p for p in parallel.module.parameters() if p.grad is not None]
    if isinstance(parallel, Pipeline) and parallel.last and not parallel.first:
        return params, [p for p in params if p is not parallel.module.tok_emb.weight]
    return params, params


def clip_grad_norm_(parallel, max_norm):
    """Gradient clipping over the whole model with torch's own functions, wherever its parts live:
    the total norm of this process's gradients (a DTensor's norm includes the parts other processes
    hold along the mesh dimensions it is split over), its square summed over the pipeline's stages,
    then every gradient scaled by the same factor as in one process."""
    params, counted = counted_once(parallel)
    norm = torch.nn.utils.get_total_norm([p.grad for p in counted])
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if isinstance(parallel, Pipeline):
        squares = norm.float().square()
        dist.all_reduce(squares, group=parallel.group)
        norm = squares.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def replica_digests(parallel):
    """{kind: SHA-256 of this process's parts}, one kind per set of mesh dimensions the
    parameters are split along; "tied": the embedding copy of a pipeline's first and last
    stage. Processes that differ only along the other dimensions (those that replicate)
    must end with the same digest."""
    groups = {}
    for p in parallel.module.parameters():
        groups.setdefault(",".join(sharded_dims(p)), []).append(local(p))
    if isinstance(parallel, Pipeline) and (parallel.first or parallel.last):
        groups["tied"] = [local(parallel.module.tok_emb.weight)]
    out = {}
    for kind, tensors in groups.items():
        h = hashlib.sha256()
        for t in tensors:
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        out[kind] = h.hexdigest()[:16]
    return out


def replica_mismatches(layout, digests):
    """(compared, mismatches) from every rank's replica_digests, in rank order: for each kind,
    the ranks that share every coordinate but those of the dimensions replicating it are
    compared; mismatches names each set of ranks that disagree. Only digests travel: no
    process gathers another's weights."""
    classes = {}
    for rank, kinds in enumerate(digests):
        coords = layout.coords(rank)
        for kind, digest in kinds.items():
            if kind == "tied":  # across the pipeline's ends, every other coordinate the same
                key = tuple(coords[d] for d in DATA_DIMS)
            else:  # along the dimensions it is not split over, within one stage
                split = kind.split(",") if kind else []
                key = (coords["pp"], *(coords[d] for d in split))
            classes.setdefault((kind, key), []).append((rank, digest))
    compared = [members for members in classes.values() if len(members) > 1]
    mismatches = [
        f"{kind or 'whole'} weights of ranks {[r for r, _ in members]}: {[d for _, d in members]}"
        for (kind, _), members in classes.items()
        if len({d for _, d in members}) > 1
    ]
    return sum(len(m) for m in compared), mismatches


def check_replicas(layout, digests):
    """Processes that hold copies of the same part (along the dimensions that replicate it) must
    end with it bit for bit, compared by every rank's replica_digests (nothing gathered): the line
    to log, or RuntimeError naming the ranks that differ."""
    compared, mismatches = replica_mismatches(layout, digests)
    if mismatches:
        raise RuntimeError("replicas differ at the end of the run: " + "; ".join(mismatches))
    if not compared:
        return "no weights are replicated across processes in this layout: no replicas to compare"
    return f"replicas identical: {compared} copies compared across ranks"
