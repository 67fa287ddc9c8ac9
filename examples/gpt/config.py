"""The command line as one frozen Config: each option a field, declared once with its
help, its default and its checks. A preset's values are defaults that any option given on
the command line overrides."""

import math
import os
from dataclasses import dataclass
from types import SimpleNamespace

import presets
import torch
from ac import MODES as AC_MODES
from data import default_cache_dir
from observability import traces
from options import check, derived, not_negative, option, parser_for, positive, writable
from parallel.mesh import SCHEDULES, SHORTHAND, Layout, layout_checks, make_layout
from snapshots import hf


@dataclass(frozen=True)
class Config:
    """The whole command line, complete (presets filled
    in, derived fields computed) and checked."""

    model: str = option("size preset (default: gpt2 with a GPU, cpu without one)", choices=presets.PRESETS)
    data: str = option(
        "a folder of shards (prepare.py's, or nanoGPT's train.bin and val.bin), or text prepared into "
        "the cache with --tokenizer: stdlib (default), a UTF-8 file or folder, an http(s) URL",
        "stdlib",
    )
    tokenizer: str = option(
        "text --data: characters, or a byte-level BPE of --vocab_size tokens (default: the preset's)",
        choices=["char", "bpe"],
    )
    vocab_size: int | None = option(
        "--tokenizer bpe: tokens in all; nanoGPT shards, no tokenizer.json: their vocabulary (50257)",
        check=positive,
    )
    in_memory: bool = option(
        "copy the whole corpus onto every device, not reading windows from the shards (to compare)"
    )
    cache_dir: str = option("built and downloaded corpora (%(default)s)", default_cache_dir)
    timeout: float = option("seconds to wait for a download or a lock (%(default)s)", 60, positive)
    dist_timeout: float = option(
        "seconds a process waits for the others, at the start or in a collective, before failing "
        "(%(default)s)",
        600,
        positive,
    )
    n_layer: int = option(check=positive, group="model shape (default: the preset's)")
    n_head: int = option(check=positive)
    n_embd: int = option(check=positive)
    block_size: int = option(
        check=positive,  # and first, as before, the shape's other refusal:
        ok=lambda c: c.n_embd % c.n_head == 0,
        no="--n_embd {c.n_embd} is not a multiple of --n_head {c.n_head}",
    )
    dropout: float = option(
        ok=lambda c: 0 <= c.dropout < 1, no="--dropout must be in [0, 1), got {c.dropout}"
    )
    activation: str = option(
        "the MLP's GELU: exact (gelu, default) or GPT-2's tanh approximation (a GPT-2 --init_from's)",
        choices=["gelu", "gelu_tanh"],
    )
    bias: str = option(
        "biases in the linear layers and norms: yes (GPT-2's, a GPT-2 --init_from's) or no "
        "(nanoGPT's default: 5%% less work a CPU step) (default: the preset's)",
        choices=["yes", "no"],
    )
    max_steps: int = option(
        "optimizer steps in all", check=positive, group="training (default: the preset's)"
    )
    batch_size: int = option("sequences per micro-batch per data-parallel process", check=positive)
    grad_accum: int = option(
        "micro-batches per step, added up (%(default)s)",
        1,
        positive,
        ok=lambda c: c.grad_accum == 1 or c.layout.pp == 1,
        no="--pp {c.layout.pp}: --grad_accum {c.grad_accum}: accumulate with --pp_microbatches",
    )
    global_batch: int = derived()  # sequences a step: batch_size x grad_accum x the data-parallel degree
    lr: float = option("peak learning rate", check=positive)
    min_lr: float = option(
        "the cosine ends here (default lr / 10)",
        ok=lambda c: 0 <= c.min_lr <= c.lr,
        no="--min_lr must be in [0, lr={c.lr}], got {c.min_lr}",
    )
    warmup_steps: int = option("linear warmup from lr / warmup_steps to lr", check=not_negative)
    decay_steps: int = option("the cosine reaches min_lr at this step (default max_steps)", check=positive)
    decay_given: bool = derived()  # --decay_steps given: else a resumed run keeps its snapshot's
    weight_decay: float = option("AdamW, on weight matrices (%(default)s)", 0.1, not_negative)
    grad_clip: float = option("max gradient norm; 0: none (%(default)s)", 1.0, not_negative)
    skip_nonfinite: int = option(
        "skip up to N steps whose loss or gradient norm is not finite, instead of stopping (%(default)s)",
        0,
        not_negative,
        metavar="N",
    )
    seed: int = option(
        "initial weights, batches, dropout (%(default)s)",
        1337,
        ok=lambda c: 0 <= c.seed < 2**32,
        no="--seed must be in [0, 2**32), got {c.seed}",
    )
    eval_every: int = option(
        "validation loss every this many steps, and at the end",
        check=positive,
        group="evaluation, logging, profiling",
    )
    eval_samples: int = option("validation sequences per evaluation", check=positive)
    log_every: int = option("a log line every this many steps", check=positive)
    metrics_path: str | None = option(
        "append one JSON line per log line and per evaluation; TensorBoard event files beside it",
        check=writable,
    )
    no_tensorboard: bool = option("--metrics_path: the JSON lines alone, no event files")
    slow_factor: float = option(
        "at each log line, name a process whose data and forward passes take longer than this many "
        "times the median process's; 0: do not time the processes (%(default)s)",
        1.5,
        ok=lambda c: c.slow_factor == 0 or c.slow_factor >= 1,
        no="--slow_factor must be 0 or 1 or more, got {c.slow_factor}",
    )
    profile_steps: tuple[int, int] | None = option(
        "torch.profiler over steps A to B: a Chrome/Perfetto trace per process, and its time in "
        "compute, in collectives and overlapped",
        metavar="A:B",
        type=traces.step_range,
    )
    profile_dir: str = option("--profile_steps: the traces' folder (%(default)s)", "traces", writable)
    memory_snapshot: str | None = option(
        "GPU: record every CUDA allocation and write the history to FILE at the end, for "
        "pytorch.org/memory_viz (each process: FILE.rankR)",
        check=writable,
        ok=lambda c: c.memory_snapshot is None or torch.cuda.is_available(),
        no="--memory_snapshot records CUDA allocations: it needs a GPU",
        metavar="FILE",
    )
    snapshot_path: str = option(
        "the snapshot directory to resume from and save to, any layout's (%(default)s)",
        "gpt_snapshot",
        writable,
        ok=lambda c: not os.path.isfile(c.snapshot_path),
        no="--snapshot_path {c.snapshot_path} is a file: snapshots are directories; to start from a "
        "single-file snapshot pass it as --init_from {c.snapshot_path} with another --snapshot_path",
        group="snapshots",
    )
    init_from: str | None = option(
        "a single-file snapshot (examples/gpt/export.py writes one), or a Hugging Face GPT-2 folder, "
        "to start from when --snapshot_path holds none yet",
        ok=lambda c: c.init_from is None or os.path.isfile(c.init_from) or hf.is_folder(c.init_from),
        no="--init_from {c.init_from}: neither a file nor a Hugging Face GPT-2 folder (config.json)",
        metavar="FILE",
    )
    save_every: int = option("snapshot every this many steps (%(default)s)", 100, positive)
    keep: int = option("snapshots kept, the newest (%(default)s)", 2, positive)
    sample_chars: int = option("characters generated at the end (%(default)s)", 200, not_negative)
    dtype: str = option(
        "autocast type; auto: bf16 on GPUs that have it, else fp16 with a gradient scaler; fp32 on CPU",
        "auto",
        choices=["auto", "fp32", "bf16", "fp16"],
        group="speed and memory",
    )
    loss_scale: float = option(
        "fp16: the loss scale to start from; halved at each overflow, doubled after 2000 clean steps "
        "(%(default)s, GradScaler's)",
        2.0**16,
        positive,
    )
    attention: str = option(
        "attention kernel; auto: torch's choice, order and switches (%(default)s)",
        "auto",
        choices=["auto", "cudnn", "flash", "efficient", "math"],
        group="speed and memory",
    )
    compile: bool = option("torch.compile each block, in every layout")
    compile_mode: str = option(
        "--compile: torch.compile's mode; max-autotune-no-cudagraphs times several kernels for each "
        "matmul at the first step and keeps the fastest (%(default)s)",
        "default",
        ok=lambda c: c.compile or c.compile_mode == "default",
        no="--compile_mode {c.compile_mode} is for --compile",
        choices=["default", "max-autotune-no-cudagraphs"],
    )
    comm_hook: str | None = option("DDP: all-reduce gradients in 16 bits", choices=["fp16", "bf16"])
    peak_tflops: float | None = option(
        "the device's dense peak, for MFU (known GPUs: auto)",
        ok=lambda c: c.peak_tflops is None or c.peak_tflops > 0,
        no="--peak_tflops must be positive",
    )
    ac: str = option(
        "activation checkpointing: blocks keep only their input and recompute the rest in backward; "
        "full: every block, selective: every --ac_every-th block (%(default)s)",
        "none",
        choices=AC_MODES,
    )
    ac_every: int | None = option(  # not given: 2 under --ac selective, else None
        "--ac selective: every this many blocks recompute (2)",
        check=positive,
        ok=lambda c: c.ac_every is None or c.ac == "selective",
        no="--ac_every is for --ac selective (this run: --ac {c.ac})",
    )
    pp: int | None = option(
        "pipeline stages, consecutive blocks each (1)",
        group="parallelism: a device mesh pp x dp_replicate x dp_shard x tp, whose product is the "
        "number of processes (docs/parallelism.md)",
    )
    dp_replicate: int | None = option("data-parallel replicas (DDP; with dp_shard, HSDP) (1)")
    dp_shard: int | None = option(
        "data-parallel processes that shard parameters, gradients and AdamW state (FSDP2) (1)"
    )
    tp: int | None = option("tensor-parallel processes that split every block's matrices (1)")
    parallel: str | None = option(  # ddp when neither it nor a degree is given
        "shorthand for one dimension of all the processes: ddp (--dp_replicate), zero (the same with "
        "AdamW's state split), fsdp (--dp_shard), tp (--tp), pp (--pp); default: ddp",
        choices=SHORTHAND,
    )
    pp_schedule: str = option(
        "pp: all forwards then all backwards (gpipe), or interleaved, fewer activations held (1f1b)",
        "1f1b",
        choices=SCHEDULES,
    )
    pp_microbatches: int = option("pp: micro-batches each batch is cut into (%(default)s)", 4, positive)
    # parallel/mesh.py's make_layout, from the degrees or
    # --parallel and WORLD_SIZE; its checks mesh.py's
    layout: Layout = derived(lambda c, _: layout_checks(c, c.layout, torch.cuda.is_available()))  # noqa: RUF009


def get_parser():
    return parser_for(Config, "Train a GPT, alone or under torchrun.")


def parse_args(argv=None):
    """The parser and the Config: parsed, the preset (or a GPT-2 folder's shape)
    filled in, derived values computed, then checked; nonsense is refused with an
    argparse message and exit status 2."""
    parser = get_parser()
    values = vars(parser.parse_args(argv))
    values["model"] = values["model"] or ("gpt2" if torch.cuda.is_available() else "cpu")
    preset_warmup = values["warmup_steps"] is None  # the preset's is capped below; one given is kept
    if hf.is_folder(values["init_from"]):  # a Hugging Face GPT-2: its shape, where none is given
        try:
            shape = hf.read_config(values["init_from"])
        except hf.HFError as exc:
            parser.error(str(exc))
        for key in ("n_layer", "n_head", "n_embd", "block_size", "activation", "bias"):
            values[key] = shape[key] if values[key] is None else values[key]
    values["activation"] = values["activation"] or "gelu"
    values |= {key: value for key, value in presets.PRESETS[values["model"]].items() if values[key] is None}
    for key, value in values.items():  # nan and inf pass every comparison, or wrongly fail it
        if isinstance(value, float) and not math.isfinite(value):
            parser.error(f"--{key} must be a finite number, got {value}")
    if values["parallel"] is None and all(values[name] is None for name in Layout.NAMES):
        values["parallel"] = "ddp"
    try:
        layout = make_layout(SimpleNamespace(**values), int(os.environ.get("WORLD_SIZE", 1)))
    except ValueError as exc:
        parser.error(str(exc))
    max_steps, warmup = values["max_steps"], values["warmup_steps"]
    cut = preset_warmup and 0 < max_steps and warmup > int(max_steps * presets.WARMUP_FRACTION)
    config = Config(
        **values
        | dict(
            layout=layout,
            global_batch=values["batch_size"] * values["grad_accum"] * layout.dp,
            decay_given=values["decay_steps"] is not None,
            decay_steps=max_steps if values["decay_steps"] is None else values["decay_steps"],
            min_lr=values["lr"] / 10 if values["min_lr"] is None else values["min_lr"],
            warmup_steps=int(max_steps * presets.WARMUP_FRACTION) if cut else warmup,
            ac_every=2 if values["ac_every"] is None and values["ac"] == "selective" else values["ac_every"],
        )
    )
    check(config, parser)
    if os.getenv("TORCHELASTIC_USE_AGENT_STORE") == "True" and os.getenv("TORCHELASTIC_MAX_RESTARTS") != "0":
        parser.error(
            "restarts need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone ...: with "
            "torchrun's store shared, restarted processes can wait forever (docs/fault-tolerance.md)"
        )
    if cut and os.getenv("RANK", "0") == "0":
        print(
            f"the preset's warm-up cut to {config.warmup_steps} steps from {warmup}: "
            f"{presets.WARMUP_FRACTION:.0%} of --max_steps"
        )
    return parser, config
