"""Command line and size presets. Preset values are defaults: any option given on the command line wins."""

import argparse
import math
import os
from dataclasses import dataclass

import torch
from ac import MODES as AC_MODES
from failures import failure
from snapshots import hf

# Model shape and the training settings that suit it.
PRESETS = {
    # about 0.8M parameters: a few thousand steps of this learn Python's look on two CPU cores
    "cpu": dict(
        n_layer=4, n_head=4, n_embd=128, block_size=128, dropout=0.0, batch_size=16, lr=1e-3,
        warmup_steps=20, max_steps=300, eval_every=100, eval_samples=256, log_every=10, tokenizer="char",
    ),
    # about 10.7M parameters, one GPU for minutes
    "mini": dict(
        n_layer=6, n_head=6, n_embd=384, block_size=256, dropout=0.1, batch_size=64, lr=1e-3,
        warmup_steps=100, max_steps=3000, eval_every=250, eval_samples=2048, log_every=10, tokenizer="char",
    ),
    # GPT-2 small's shape (12 layers, 12 heads, width 768, context 1024) and its 50257-token byte-level BPE
    # vocabulary: 124M parameters (85M with --tokenizer char)
    "gpt2": dict(
        n_layer=12, n_head=12, n_embd=768, block_size=1024, dropout=0.0, batch_size=16, lr=6e-4,
        warmup_steps=200, max_steps=2000, eval_every=250, eval_samples=1024, log_every=10, tokenizer="bpe",
    ),
}  # fmt: skip
MODEL_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "dropout", "activation")
# --parallel NAME: the one-dimensional layout it stands for, all processes along one mesh dimension
SHORTHAND = {"ddp": "dp_replicate", "zero": "dp_replicate", "fsdp": "dp_shard", "tp": "tp", "pp": "pp"}
SCHEDULES = ("gpipe", "1f1b")  # --pp_schedule
WARMUP_FRACTION = 0.1  # a preset's warm-up takes at most this share of --max_steps: not all warm-up


@dataclass(frozen=True)
class Layout:
    """How the processes share the work: a device mesh of four named dimensions, outermost first (as
    torchtitan orders them, so that tp's processes are neighbours, on one node): pipeline stages (pp), then
    replicas (dp_replicate: DDP, or HSDP's replicas), then shards of the data-parallel state (dp_shard:
    FSDP), then tensor-parallel parts of each matrix (tp). Rank r sits at the coordinates r has written in
    mixed radix (pp, dp_replicate, dp_shard, tp). The data-parallel processes (dp_replicate x dp_shard of
    them) each read their own share of a batch; the pp and tp processes of one share read the same one."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    zero: bool = False  # dp_replicate's AdamW state split over the replicas (ZeroRedundancyOptimizer)

    NAMES = ("pp", "dp_replicate", "dp_shard", "tp")
    # The process that logs, writes the metrics file and commits each snapshot (its extra state and the
    # pointer to it): the one at coordinate 0 of every dimension, on the first pipeline stage.
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


class Parser(argparse.ArgumentParser):
    """argparse, whose errors are the last line a user sees: under torchrun said once, in torchrun's closing
    summary; alone after one line of usage, not the whole list of options."""

    def error(self, message):
        if "TORCHELASTIC_ERROR_FILE" not in os.environ:
            self.exit(2, f"usage: {self.prog} [options] (--help lists them)\n{self.prog}: error: {message}\n")
        failure.refuse(self.prog, message)


# Each concern declares its options (help and default) and returns the checks of their values, (ok, the
# message when not), made once the preset has filled in what the command line left out.


def positive(args, *names):
    return [(getattr(args, n) > 0, f"--{n} must be positive, got {getattr(args, n)}") for n in names]


def not_negative(args, *names):
    return [(getattr(args, n) >= 0, f"--{n} must be 0 or more, got {getattr(args, n)}") for n in names]


def data_options(p):
    p.add_argument("--model", choices=PRESETS, help="size preset (default: gpt2 with a GPU, cpu without one)")
    p.add_argument(
        "--data", default="stdlib",
        help="a folder of shards (prepare.py's, or nanoGPT's train.bin and val.bin), or text prepared into "
        "the cache with --tokenizer: stdlib (default), a UTF-8 file or folder, an http(s) URL",
    )  # fmt: skip
    p.add_argument(
        "--tokenizer", choices=["char", "bpe"],
        help="text --data: characters, or a byte-level BPE of --vocab_size tokens (default: the preset's)",
    )  # fmt: skip
    p.add_argument(
        "--vocab_size", type=int,
        help="--tokenizer bpe: tokens in all; nanoGPT shards, no tokenizer.json: their vocabulary (50257)",
    )  # fmt: skip
    p.add_argument(
        "--in_memory", action="store_true",
        help="copy the whole corpus onto every device, not reading windows from the shards (to compare)",
    )  # fmt: skip
    p.add_argument(
        "--cache_dir", default=default_cache_dir(), help="built and downloaded corpora (%(default)s)"
    )
    p.add_argument("--timeout", type=float, default=60, help="seconds to wait for a download or a lock (60)")
    p.add_argument(
        "--dist_timeout", type=float, default=600,
        help="seconds a process waits for the others, at the start or in a collective, before failing (600)",
    )  # fmt: skip
    return lambda args: [
        (
            args.vocab_size is None or args.vocab_size > 0,
            f"--vocab_size must be positive, got {args.vocab_size}",
        ),
        *positive(args, "timeout", "dist_timeout"),
    ]


def model_options(p):
    group = p.add_argument_group("model shape (default: the preset's)")
    for key in ("n_layer", "n_head", "n_embd", "block_size"):
        group.add_argument(f"--{key}", type=int)
    group.add_argument("--dropout", type=float)
    group.add_argument(
        "--activation", choices=["gelu", "gelu_tanh"],
        help="the MLP's GELU: exact (gelu, default) or GPT-2's tanh approximation (a GPT-2 --init_from's)",
    )  # fmt: skip
    return lambda args: [
        *positive(args, "n_layer", "n_head", "n_embd", "block_size"),
        (
            args.n_head <= 0 or args.n_embd % args.n_head == 0,  # (a zero is refused above)
            f"--n_embd {args.n_embd} is not a multiple of --n_head {args.n_head}",
        ),
        (0 <= args.dropout < 1, f"--dropout must be in [0, 1), got {args.dropout}"),
    ]


def training_options(p):
    group = p.add_argument_group("training (default: the preset's)")
    group.add_argument("--max_steps", type=int, help="optimizer steps in all")
    group.add_argument("--batch_size", type=int, help="sequences per micro-batch per data-parallel process")
    group.add_argument("--grad_accum", type=int, default=1, help="micro-batches per step, added up (1)")
    group.add_argument("--lr", type=float, help="peak learning rate")
    group.add_argument("--min_lr", type=float, help="the cosine ends here (default lr / 10)")
    group.add_argument("--warmup_steps", type=int, help="linear warmup from lr / warmup_steps to lr")
    group.add_argument(
        "--decay_steps", type=int, help="the cosine reaches min_lr at this step (default max_steps)"
    )
    group.add_argument("--weight_decay", type=float, default=0.1, help="AdamW, on weight matrices (0.1)")
    group.add_argument("--grad_clip", type=float, default=1.0, help="max gradient norm; 0: none (1.0)")
    group.add_argument(
        "--skip_nonfinite", type=int, default=0, metavar="N",
        help="skip up to N steps whose loss or gradient norm is not finite, instead of stopping (0)",
    )  # fmt: skip
    group.add_argument("--seed", type=int, default=1337, help="initial weights, batches, dropout (1337)")
    return lambda args: [
        *positive(args, "max_steps", "batch_size", "grad_accum", "lr", "decay_steps"),
        (0 <= args.min_lr <= args.lr, f"--min_lr must be in [0, lr={args.lr}], got {args.min_lr}"),
        *not_negative(args, "warmup_steps", "weight_decay", "grad_clip", "skip_nonfinite"),
        (0 <= args.seed < 2**32, f"--seed must be in [0, 2**32), got {args.seed}"),
    ]


def metrics_options(p):
    group = p.add_argument_group("evaluation, logging, profiling")
    group.add_argument("--eval_every", type=int, help="validation loss every this many steps, and at the end")
    group.add_argument("--eval_samples", type=int, help="validation sequences per evaluation")
    group.add_argument("--log_every", type=int, help="a log line every this many steps")
    group.add_argument(
        "--metrics_path",
        help="append one JSON line per log line and per evaluation; TensorBoard event files beside it",
    )
    group.add_argument(
        "--no_tensorboard", action="store_true", help="--metrics_path: the JSON lines alone, no event files"
    )
    group.add_argument(
        "--slow_factor", type=float, default=1.5,
        help="at each log line, name a process whose data and forward passes take longer than this many "
        "times the median process's; 0: do not time the processes (1.5)",
    )  # fmt: skip
    group.add_argument(
        "--profile_steps", metavar="A:B", type=step_range,
        help="torch.profiler over steps A to B: a Chrome/Perfetto trace per process, and its time in "
        "compute, in collectives and overlapped",
    )  # fmt: skip
    group.add_argument("--profile_dir", default="traces", help="--profile_steps: the traces' folder (traces)")
    group.add_argument(
        "--memory_snapshot", metavar="FILE",
        help="GPU: record every CUDA allocation and write the history to FILE at the end, for "
        "pytorch.org/memory_viz (each process: FILE.rankR)",
    )  # fmt: skip
    return lambda args: [
        *positive(args, "eval_every", "eval_samples", "log_every"),
        (
            args.slow_factor == 0 or args.slow_factor >= 1,
            f"--slow_factor must be 0 or 1 or more, got {args.slow_factor}",
        ),
        (
            torch.cuda.is_available() or args.memory_snapshot is None,
            "--memory_snapshot records CUDA allocations: it needs a GPU",
        ),
    ]


def snapshot_options(p):
    group = p.add_argument_group("snapshots")
    group.add_argument(
        "--snapshot_path", default="gpt_snapshot",
        help="the snapshot directory to resume from and save to, any layout's (%(default)s)",
    )  # fmt: skip
    group.add_argument(
        "--init_from", metavar="FILE",
        help="a single-file snapshot (examples/gpt/export.py writes one), or a Hugging Face GPT-2 folder, "
        "to start from when --snapshot_path holds none yet",
    )  # fmt: skip
    group.add_argument("--save_every", type=int, default=100, help="snapshot every this many steps (100)")
    group.add_argument("--keep", type=int, default=2, help="snapshots kept, the newest (2)")
    group.add_argument("--sample_chars", type=int, default=200, help="characters generated at the end (200)")
    return lambda args: [
        *positive(args, "save_every", "keep"),
        *not_negative(args, "sample_chars"),
        (
            not os.path.isfile(args.snapshot_path),
            f"--snapshot_path {args.snapshot_path} is a file: snapshots are directories; to start from a "
            f"single-file snapshot pass it as --init_from {args.snapshot_path} with another --snapshot_path",
        ),
        (
            args.init_from is None or os.path.isfile(args.init_from) or hf.is_folder(args.init_from),
            f"--init_from {args.init_from}: neither a file nor a Hugging Face GPT-2 folder (config.json)",
        ),
    ]


def speed_options(p):
    group = p.add_argument_group("speed and memory")
    group.add_argument(
        "--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
        help="autocast type; auto: bf16 on GPUs that have it, else fp16 with a gradient scaler; fp32 on CPU",
    )  # fmt: skip
    group.add_argument("--compile", action="store_true", help="torch.compile each block, in every layout")
    group.add_argument(
        "--compile_mode", choices=["default", "max-autotune-no-cudagraphs"], default="default",
        help="--compile: torch.compile's mode; max-autotune-no-cudagraphs times several kernels for each "
        "matmul at the first step and keeps the fastest (%(default)s)",
    )  # fmt: skip
    group.add_argument("--comm_hook", choices=["fp16", "bf16"], help="DDP: all-reduce gradients in 16 bits")
    group.add_argument(
        "--peak_tflops", type=float, help="the device's dense peak, for MFU (known GPUs: auto)"
    )
    group.add_argument(
        "--ac", choices=AC_MODES, default="none",
        help="activation checkpointing: blocks keep only their input and recompute the rest in backward; "
        "full: every block, selective: every --ac_every-th block (none)",
    )  # fmt: skip
    group.add_argument("--ac_every", type=int, help="--ac selective: every this many blocks recompute (2)")
    return lambda args: [
        (args.peak_tflops is None or args.peak_tflops > 0, "--peak_tflops must be positive"),
        (
            args.compile or args.compile_mode == "default",
            f"--compile_mode {args.compile_mode} is for --compile",
        ),
        (
            args.ac_every is None or args.ac == "selective",
            f"--ac_every is for --ac selective (this run: --ac {args.ac})",
        ),
        (args.ac_every is None or args.ac_every > 0, f"--ac_every must be positive, got {args.ac_every}"),
        (
            torch.cuda.is_available() or args.dtype != "fp16",
            "--dtype fp16 needs a GPU (its gradient scaler is for CUDA)",
        ),
    ]


def parallel_options(p):
    group = p.add_argument_group(
        "parallelism: a device mesh pp x dp_replicate x dp_shard x tp, whose product is the number of "
        "processes (docs/parallelism.md)"
    )
    for name, text in [
        ("pp", "pipeline stages, consecutive blocks each"),
        ("dp_replicate", "data-parallel replicas (DDP; with dp_shard, HSDP)"),
        ("dp_shard", "data-parallel processes that shard parameters, gradients and AdamW state (FSDP2)"),
        ("tp", "tensor-parallel processes that split every block's matrices"),
    ]:
        group.add_argument(f"--{name}", type=int, help=f"{text} (1)")
    group.add_argument(
        "--parallel", choices=SHORTHAND,
        help="shorthand for one dimension of all the processes: ddp (--dp_replicate), zero (the same with "
        "AdamW's state split), fsdp (--dp_shard), tp (--tp), pp (--pp); default: ddp",
    )  # fmt: skip
    group.add_argument(
        "--pp_schedule", choices=SCHEDULES, default="1f1b",
        help="pp: all forwards then all backwards (gpipe), or interleaved, fewer activations held (1f1b)",
    )  # fmt: skip
    group.add_argument(
        "--pp_microbatches", type=int, default=4, help="pp: micro-batches each batch is cut into (4)"
    )
    return lambda args: [
        *positive(args, "pp_microbatches"),
        *layout_checks(args, args.layout, torch.cuda.is_available()),
        (
            os.getenv("TORCHELASTIC_USE_AGENT_STORE") != "True"
            or os.getenv("TORCHELASTIC_MAX_RESTARTS") == "0",
            "restarts need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone ...: with "
            "torchrun's store shared, restarted processes can wait forever (docs/fault-tolerance.md)",
        ),
    ]


CONCERNS = (
    data_options, model_options, training_options, metrics_options, snapshot_options, speed_options,
    parallel_options,
)  # fmt: skip


def get_parser():
    """The parser, whose `checks` are every concern's."""
    p = Parser(description="Train a GPT, alone or under torchrun.")
    p.checks = [declare(p) for declare in CONCERNS]
    return p


def step_range(text):
    """'A:B' -> (A, B), steps counted from 1, A <= B."""
    try:
        first, last = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FIRST:LAST, two step numbers, got {text!r}") from None
    if not 1 <= first <= last:
        raise argparse.ArgumentTypeError(f"expected 1 <= FIRST <= LAST, got {text!r}")
    return first, last


def default_cache_dir():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ddp-examples", "gpt")


def parse_args(argv=None):
    """Parse, fill in the preset, reject nonsense with an argparse message and exit status 2."""
    parser = get_parser()
    args = parser.parse_args(argv)
    args.model = args.model or ("gpt2" if torch.cuda.is_available() else "cpu")
    preset_warmup = args.warmup_steps is None  # the preset's is capped below; one given is kept as given
    if hf.is_folder(args.init_from):  # a Hugging Face GPT-2: its shape, where the command line gives none
        try:
            shape = hf.read_config(args.init_from)
        except hf.HFError as exc:
            parser.error(str(exc))
        for key in ("n_layer", "n_head", "n_embd", "block_size", "activation"):
            if getattr(args, key) is None:
                setattr(args, key, shape[key])
    args.activation = args.activation or "gelu"
    for key, value in PRESETS[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key, value in vars(args).items():  # nan and inf pass every comparison below, or wrongly fail it
        if isinstance(value, float) and not math.isfinite(value):
            parser.error(f"--{key} must be a finite number, got {value}")
    try:
        args.layout = make_layout(args, int(os.environ.get("WORLD_SIZE", 1)))
    except ValueError as exc:
        parser.error(str(exc))
    args.decay_given = args.decay_steps is not None  # else a resumed run keeps its snapshot's
    args.decay_steps = args.max_steps if args.decay_steps is None else args.decay_steps
    args.min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    for check in parser.checks:
        for ok, message in check(args):
            if not ok:
                parser.error(message)
    most = int(args.max_steps * WARMUP_FRACTION)
    if preset_warmup and args.warmup_steps > most:
        if os.getenv("RANK", "0") == "0":
            print(f"the preset's warm-up cut to {most} steps from {args.warmup_steps}: "
                  f"{WARMUP_FRACTION:.0%} of --max_steps")  # fmt: skip
        args.warmup_steps = most
    args.ac_every = 2 if args.ac_every is None else args.ac_every
    for option in ("snapshot_path", "metrics_path", "profile_dir", "memory_snapshot"):  # now, not at the end
        problem = unwritable(getattr(args, option))
        if problem:
            parser.error(f"--{option} {getattr(args, option)}: {problem}")
    return parser, args


def make_layout(args, world):
    """The Layout of these arguments for `world` processes; ValueError (one line) when they cannot make
    one. Degrees not given are 1; --parallel NAME puts every process along NAME's dimension."""
    given = {name: getattr(args, name) for name in Layout.NAMES if getattr(args, name) is not None}
    if args.parallel is None and not given:
        args.parallel = "ddp"
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


def layout_checks(args, layout, cuda):
    """Sizes that do not split over the layout, found here, before any process group forms."""
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
                args.grad_accum == 1,
                f"--pp {layout.pp}: --grad_accum {args.grad_accum}: accumulate with --pp_microbatches",
            ),
            (
                resolve_dtype(args.dtype, torch.device("cuda" if cuda else "cpu")) != torch.float16,
                f"--pp {layout.pp}: --dtype fp16 (auto's choice on GPUs without bf16) needs a gradient "
                "scaler, which the pipeline lacks here: pass --dtype fp32 or bf16",
            ),
        ]
    return checks


def unwritable(path):
    """Why a file or directory could not be written at path, or None: an existing directory there (a
    snapshot folder, written into) must itself be writable, else the nearest folder that exists on the
    way to it must be a writable directory. Nothing is created."""
    if path is None:
        return None
    if os.path.isdir(path):
        return None if os.access(path, os.W_OK | os.X_OK) else f"{path} is not writable"
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        return f"{folder} is not a directory"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{folder} is not writable"
    return None


def native_bf16():
    """bfloat16 in hardware (compute capability 8.0 on): is_bf16_supported() alone counts emulation too."""
    return torch.cuda.is_bf16_supported(including_emulation=False)


def resolve_dtype(name, device):
    """--dtype as a torch dtype: auto is bfloat16 on GPUs that have it, else float16; float32 on CPUs."""
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if native_bf16() else torch.float16
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
