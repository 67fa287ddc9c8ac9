"""Command line and size presets. Preset values are defaults: any option given on the command line wins."""

import argparse
import math
import os

import torch
from parallel import SCHEDULES, SHARDED_SNAPSHOTS, SPLIT_MODEL, STRATEGIES

# Model shape and the training settings that suit it.
PRESETS = {
    # about 0.8M parameters: a few thousand steps of this learn Python's look on two CPU cores
    "cpu": dict(
        n_layer=4, n_head=4, n_embd=128, block_size=128, dropout=0.0, batch_size=16, lr=1e-3,
        warmup_steps=20, max_steps=300, eval_every=100, eval_samples=256, log_every=10,
    ),
    # about 10.7M parameters, one GPU for minutes
    "mini": dict(
        n_layer=6, n_head=6, n_embd=384, block_size=256, dropout=0.1, batch_size=64, lr=1e-3,
        warmup_steps=100, max_steps=3000, eval_every=250, eval_samples=2048, log_every=10,
    ),
    # GPT-2 small's shape (12 layers, 12 heads, width 768, context 1024): 124M parameters with GPT-2's
    # 50257-token vocabulary, 85M with a character vocabulary
    "gpt2": dict(
        n_layer=12, n_head=12, n_embd=768, block_size=1024, dropout=0.0, batch_size=16, lr=6e-4,
        warmup_steps=200, max_steps=2000, eval_every=250, eval_samples=1024, log_every=10,
    ),
}  # fmt: skip
MODEL_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "dropout")
POSITIVE = (
    "n_layer", "n_head", "n_embd", "block_size", "batch_size", "lr", "max_steps", "eval_every",
    "eval_samples", "log_every", "grad_accum", "save_every", "timeout", "pp_microbatches",
)  # fmt: skip


def get_parser():
    p = argparse.ArgumentParser(description="Train a character-level GPT, alone or under torchrun (DDP).")
    p.add_argument("--model", choices=PRESETS, help="size preset (default: gpt2 with a GPU, cpu without one)")
    p.add_argument("--data", default="stdlib", help="stdlib (default), a UTF-8 text file, or an http(s) URL")
    p.add_argument(
        "--cache_dir", default=default_cache_dir(), help="built and downloaded corpora (%(default)s)"
    )
    p.add_argument("--timeout", type=float, default=60, help="seconds to wait for a download or a lock (60)")
    group = p.add_argument_group("model shape (default: the preset's)")
    for key in ("n_layer", "n_head", "n_embd", "block_size"):
        group.add_argument(f"--{key}", type=int)
    group.add_argument("--dropout", type=float)
    group = p.add_argument_group("training (default: the preset's)")
    group.add_argument("--max_steps", type=int, help="optimizer steps in all")
    group.add_argument("--batch_size", type=int, help="sequences per micro-batch per process")
    group.add_argument("--grad_accum", type=int, default=1, help="micro-batches per step, added up (1)")
    group.add_argument("--lr", type=float, help="peak learning rate")
    group.add_argument("--min_lr", type=float, help="the cosine ends here (default lr / 10)")
    group.add_argument("--warmup_steps", type=int, help="linear warmup from lr / warmup_steps to lr")
    group.add_argument(
        "--decay_steps", type=int, help="the cosine reaches min_lr at this step (default max_steps)"
    )
    group.add_argument("--weight_decay", type=float, default=0.1, help="AdamW, on weight matrices (0.1)")
    group.add_argument("--grad_clip", type=float, default=1.0, help="max gradient norm; 0: none (1.0)")
    group.add_argument("--seed", type=int, default=1337, help="initial weights, batches, dropout (1337)")
    group = p.add_argument_group("evaluation, logging, snapshots")
    group.add_argument("--eval_every", type=int, help="validation loss every this many steps, and at the end")
    group.add_argument("--eval_samples", type=int, help="validation sequences per evaluation")
    group.add_argument("--log_every", type=int, help="a log line every this many steps")
    group.add_argument("--metrics_path", help="append one JSON line per log line and per evaluation")
    group.add_argument(
        "--snapshot_path",
        help="resume from, save to (gpt_snapshot.pt; a directory, gpt_snapshot, for --parallel fsdp)",
    )
    group.add_argument("--save_every", type=int, default=100, help="snapshot every this many steps (100)")
    group.add_argument("--sample_chars", type=int, default=200, help="characters generated at the end (200)")
    group = p.add_argument_group("speed")
    group.add_argument(
        "--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
        help="autocast type; auto: bf16 on GPUs that have it, else fp16 with a gradient scaler; fp32 on CPU",
    )  # fmt: skip
    group.add_argument("--compile", action="store_true", help="torch.compile the model")
    group.add_argument("--comm_hook", choices=["fp16", "bf16"], help="DDP: all-reduce gradients in 16 bits")
    group.add_argument(
        "--parallel", choices=STRATEGIES, default="ddp",
        help="how processes share the work: ddp (a replica each), zero (AdamW state split), fsdp (everything "
        "split), tp (every block's matrices split), pp (consecutive blocks each, a pipeline) (ddp)",
    )  # fmt: skip
    group.add_argument(
        "--pp_schedule", choices=SCHEDULES, default="1f1b",
        help="pp: all forwards then all backwards (gpipe), or interleaved, fewer activations held (1f1b)",
    )  # fmt: skip
    group.add_argument(
        "--pp_microbatches", type=int, default=4, help="pp: micro-batches each batch is cut into (4)"
    )
    group.add_argument(
        "--peak_tflops", type=float, help="the device's dense peak, for MFU (known GPUs: auto)"
    )
    return p


def default_cache_dir():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ddp-examples", "gpt")


def parse_args(argv=None):
    """Parse, fill in the preset, reject nonsense with an argparse message and exit status 2."""
    parser = get_parser()
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    args.model = args.model or ("gpt2" if cuda else "cpu")
    for key, value in PRESETS[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key, value in vars(args).items():  # nan and inf pass every comparison below, or wrongly fail it
        if isinstance(value, float) and not math.isfinite(value):
            parser.error(f"--{key} must be a finite number, got {value}")
    for key in POSITIVE:
        if getattr(args, key) <= 0:
            parser.error(f"--{key} must be positive, got {getattr(args, key)}")
    args.decay_given = args.decay_steps is not None  # else a resumed run keeps its snapshot's
    args.decay_steps = args.max_steps if args.decay_steps is None else args.decay_steps
    args.min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    sharded = args.parallel in SHARDED_SNAPSHOTS
    args.snapshot_path = args.snapshot_path or ("gpt_snapshot" if sharded else "gpt_snapshot.pt")
    checks = [
        (
            args.n_embd % args.n_head == 0,
            f"--n_embd {args.n_embd} is not a multiple of --n_head {args.n_head}",
        ),
        (0 <= args.dropout < 1, f"--dropout must be in [0, 1), got {args.dropout}"),
        (0 <= args.min_lr <= args.lr, f"--min_lr must be in [0, lr={args.lr}], got {args.min_lr}"),
        (args.warmup_steps >= 0, f"--warmup_steps must be 0 or more, got {args.warmup_steps}"),
        (args.decay_steps > 0, f"--decay_steps must be positive, got {args.decay_steps}"),
        (args.weight_decay >= 0, f"--weight_decay must be 0 or more, got {args.weight_decay}"),
        (args.grad_clip >= 0, f"--grad_clip must be 0 or more, got {args.grad_clip}"),
        (0 <= args.seed < 2**32, f"--seed must be in [0, 2**32), got {args.seed}"),
        (args.sample_chars >= 0, f"--sample_chars must be 0 or more, got {args.sample_chars}"),
        (args.peak_tflops is None or args.peak_tflops > 0, "--peak_tflops must be positive"),
        (cuda or args.dtype != "fp16", "--dtype fp16 needs a GPU (its gradient scaler is for CUDA)"),
        (
            sharded or not os.path.isdir(args.snapshot_path),
            f"--snapshot_path {args.snapshot_path} is a directory (--parallel fsdp's sharded snapshots are; "
            "examples/gpt/export.py makes one file of them)",
        ),
        (
            not sharded or not os.path.isfile(args.snapshot_path),
            f"--snapshot_path {args.snapshot_path} is a file: --parallel {args.parallel} saves a directory",
        ),
        (not (args.comm_hook and args.parallel == "fsdp"), "--comm_hook is for DDP: fsdp reduce-scatters"),
        (
            os.getenv("TORCHELASTIC_USE_AGENT_STORE") != "True"
            or os.getenv("TORCHELASTIC_MAX_RESTARTS") == "0",
            "restarts need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --rdzv-backend=c10d ...: with "
            "torchrun's store shared, restarted processes can wait forever (docs/fault-tolerance.md)",
        ),
    ]
    for ok, message in checks + model_parallel_checks(args):
        if not ok:
            parser.error(message)
    for option in ("snapshot_path", "metrics_path"):  # found now, not at the first save after training
        problem = unwritable(getattr(args, option))
        if problem:
            parser.error(f"--{option} {getattr(args, option)}: {problem}")
    return parser, args


def unwritable(path):
    """Why a file or directory could not be created at path, or None: the nearest folder that exists on
    the way to it must be a writable directory. Nothing is created."""
    if path is None:
        return None
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        return f"{folder} is not a directory"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{folder} is not writable"
    return None


def model_parallel_checks(args):
    """tp and pp split the model over the WORLD_SIZE processes that torchrun starts: sizes that do not
    divide are found here, before any process group forms."""
    world, how, cuda = int(os.environ.get("WORLD_SIZE", 1)), args.parallel, torch.cuda.is_available()
    if how not in SPLIT_MODEL:
        return []
    checks = [
        (not args.comm_hook, f"--comm_hook compresses DDP's gradient all-reduce; --parallel {how} has none"),
        (not args.compile, f"--compile is for --parallel ddp; --parallel {how} runs the model uncompiled"),
    ]
    if how == "tp":  # the MLP width, 4 * n_embd = 4 * n_head * head width, then divides too
        checks.append(
            (
                args.n_head % world == 0,
                f"--parallel tp: --n_head {args.n_head} does not divide into {world} processes (WORLD_SIZE)",
            )
        )
    if how == "pp":
        checks += [
            (
                world >= 2,
                "--parallel pp needs at least 2 processes, one pipeline stage each (WORLD_SIZE is 1): "
                "start it with torchrun --nproc-per-node 2 or more",
            ),
            (
                world <= args.n_layer,
                f"--parallel pp: {world} pipeline stages (WORLD_SIZE) but only {args.n_layer} layers "
                "(--n_layer): at least one block per stage",
            ),
            (
                args.batch_size % args.pp_microbatches == 0,
                f"--parallel pp: --pp_microbatches {args.pp_microbatches} does not divide --batch_size "
                f"{args.batch_size}",
            ),
            (
                args.pp_schedule != "1f1b" or args.pp_microbatches >= world,
                f"--parallel pp: --pp_schedule 1f1b needs at least one micro-batch per stage: "
                f"--pp_microbatches {args.pp_microbatches} for {world} stages (WORLD_SIZE)",
            ),
            (
                args.grad_accum == 1,
                f"--parallel pp: --grad_accum {args.grad_accum}: accumulate with --pp_microbatches instead",
            ),
            (
                args.dtype != "fp16" and (args.dtype != "auto" or not cuda or native_bf16()),
                "--parallel pp: --dtype fp16 (auto's choice on GPUs without bf16) needs a gradient scaler, "
                "which pp lacks here: pass --dtype fp32 or bf16",
            ),
        ]
    return checks


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
