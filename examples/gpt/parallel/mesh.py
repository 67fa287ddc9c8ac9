"""The device mesh and its Layout: how many processes along each named dimension (pp,
dp_replicate, dp_shard, tp), from the degrees or --parallel, and the sizes that cannot split
over it, refused before any process group forms. config.py reads it without the rest."""

import math
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import init_device_mesh

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
        (
            not args.compile or layout.tp == 1 or args.ac == "none",
            f"--compile with --tp {layout.tp} and --ac {args.ac}: torch.compile cannot yet save a "
            "tensor-parallel block for recomputation (torch 2.13 fails in backward): --ac none, or no "
            "--compile",
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
