"""What a run reports. The leader prints the log lines and writes the metrics: one JSON line per
record (--metrics_path) and the same numbers as TensorBoard scalars, in event files in the same
folder (`tensorboard --logdir FOLDER`). Every process times its data and forward passes, gathered
at each log line, so that a process slower than the others is named with its host: DDP runs at its
slowest process's pace, and its step time alone would hide which one that is."""

import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
from model import attention_kernel, cpu_emulates
from processes import all_ranks

# The JSON keys written as TensorBoard scalars, and their tags.
TAGS = {
    "loss": "train/loss",
    "val_loss": "val/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "skipped": "train/skipped",
    "tokens_per_s": "perf/tokens_per_s",
    "mfu": "perf/mfu",
    "mfu_llmc": "perf/mfu_llmc",
    "step_ms": "perf/step_ms",
}

# Dense bfloat16 peak FLOP/s by GPU name, the denominator of MFU; --peak_tflops for others.
PEAK_FLOPS = [
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
]


class Metrics:
    """The leader's log and metrics; `tensorboard=False` writes the JSON lines alone."""

    def __init__(self, path, leads, tensorboard=True):
        self.path, self.leads, self.tensorboard, self.writer = path, leads, tensorboard, None

    def log(self, text):
        if self.leads:
            print(text, flush=True)

    def record(self, step, scalars=None, **fields):
        """One JSON line {"step": step, **fields}; its TAGS, and `scalars` (TensorBoard only: {tag:
        value}), as scalars at `step`."""
        if not (self.leads and self.path):
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **fields}) + "\n")
        if not self.tensorboard:
            return
        if self.writer is None:  # made at the first record: a run refused earlier leaves no event file
            from torch.utils.tensorboard import SummaryWriter  # the tensorboard package

            self.writer = SummaryWriter(os.path.dirname(os.path.abspath(self.path)))
        numbers = {TAGS[key]: value for key, value in fields.items() if key in TAGS and is_number(value)}
        for tag, value in {**numbers, **(scalars or {})}.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()  # readable now: a run stopped or killed keeps what it logged

    def close(self):
        if self.writer is not None:
            self.writer.close()


def is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class RankTimes:
    """Each process's time in data and forward passes: a context (`with times:`) adds to it, and
    gather() returns every process's mean per step since the last gather, in milliseconds. On a GPU
    the time is the device's (CUDA events), not the launches'. Under DDP the forward passes do not
    communicate, so this is a process's own pace, where step times are alike (the faster processes
    wait for the slower one in the backward pass's all-reduce); under fsdp, tp and pp the forward
    passes wait for the others too."""

    def __init__(self, device):
        self.device, self.seconds, self.events = device, 0.0, []
        self.hosts = all_ranks(socket.gethostname())

    def __enter__(self):
        if self.device.type == "cuda":
            self.events.append(torch.cuda.Event(enable_timing=True))
            self.events[-1].record()
        else:
            self.start = time.perf_counter()

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.events.append(torch.cuda.Event(enable_timing=True))
            self.events[-1].record()
        else:
            self.seconds += time.perf_counter() - self.start

    def gather(self, steps):
        """A collective: [milliseconds per step of every process], in rank order."""
        if self.events:
            torch.cuda.synchronize(self.device)
            pairs = zip(self.events[::2], self.events[1::2], strict=True)
            self.seconds += sum(start.elapsed_time(end) for start, end in pairs) / 1000
            self.events = []
        mine = torch.tensor([self.seconds * 1000 / max(steps, 1)], device=self.device)
        self.seconds = 0.0
        if not dist.is_initialized():
            return mine.tolist()
        every = torch.empty(dist.get_world_size(), device=self.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # before torch 2.13
        gather(every, mine)
        return every.tolist()

    def report(self, times, factor):
        """A line naming the fastest and slowest process, and the processes slower than `factor`
        times the median; (line, [slow ranks])."""
        median = statistics.median_low(times)  # of 2 processes, the faster one
        order = sorted(range(len(times)), key=times.__getitem__)
        fast, slow = order[0], order[-1]
        line = (
            f"data + forward per step: fastest rank {fast} {times[fast]:.1f} ms, slowest rank {slow} "
            f"{times[slow]:.1f} ms ({self.hosts[slow]}), median {median:.1f} ms"
        )
        lagging = [r for r, t in enumerate(times) if median > 0 and t > factor * median]
        for r in lagging:
            line += f"\nslow: rank {r} on {self.hosts[r]}, {times[r] / median:.2f}x the median"
        return line, lagging


def peak_flops(args, device):
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((flops for key, flops in PEAK_FLOPS if key in name), None)
    return None


def opening(t):
    """The run's first line: trainer t's model, data,
    processes, precision, attention kernel and layout."""
    a, params, dtype = t.args, t.params / 1e6, str(t.dtype).removeprefix("torch.")
    tokens = f"{t.corpus.tokenizer.kind} tokenizer" if t.corpus.tokenizer else "no tokenizer"
    heads = t.raw.cfg.n_head // t.layout.tp  # this process's share
    kernel = attention_kernel(
        t.raw.cfg, t.device, t.dtype, t.raw.cfg.dropout, a.attention, heads, a.batch_size
    )
    if t.device.type == "cpu" and cpu_emulates(t.dtype):
        dtype += " (emulated by this CPU: float32 is faster)"
    return (
        f"model {a.model}: {params:.2f}M parameters, vocabulary {t.corpus.vocab_size}, {tokens}, "
        f"{len(t.train_data)} training tokens | {t.world} process(es) on {t.device.type}, "
        f"{dtype}, attention {kernel} | layout {t.layout.describe()} | global batch "
        f"{a.global_batch} x {a.block_size} tokens"
    )


def log_interval(t, loss, norm, steps, seconds):
    """One line (and one metrics record) for trainer t's steps since the last one, nanoGPT style;
    the gradient norm is the last step's, before clipping; the learning rate the last step's. Steps
    other than --log_every (the first line after a resume, the last) are said. A collective where
    --slow_factor times the processes."""
    a, lr = t.args, t.optimizer.param_groups[0]["lr"]
    tokens_per_s = steps * a.global_batch * a.block_size / seconds
    mfu = None if t.peak is None else tokens_per_s / t.world * t.flops_per_token / t.peak
    t.log(
        f"step {t.step}/{a.max_steps} | loss {loss:.4f} | grad norm {norm:.3g} | lr {lr:.2e} | "
        f"{seconds / steps * 1000:.1f} ms/step | {tokens_per_s:.0f} tokens/s | "
        f"mfu {'-' if mfu is None else f'{100 * mfu:.1f}%'}"
        + ("" if steps == a.log_every else f" | over the {steps} steps since step {t.step - steps}")
    )
    fields = dict(loss=loss, grad_norm=norm, lr=lr, tokens_per_s=tokens_per_s)
    fields.update(step_ms=seconds / steps * 1000)
    times = t.times.gather(steps) if a.slow_factor else []  # a collective
    if len(times) > 1 and t.layout.pp == 1:  # a pipeline's forward passes wait for each other
        line, slow = t.times.report(times, a.slow_factor)
        t.log(f"step {t.step} | {line}")
        fields.update(rank_ms=times, slow_ranks=slow)
    per_rank = {f"ranks/data_forward_ms/rank{r}": ms for r, ms in enumerate(times)}
    fields.update(world_size=t.world, skipped=t.checks.skipped)
    if mfu is not None:  # also as llm.c counts the FLOPs
        fields.update(mfu=mfu, mfu_llmc=mfu * t.llmc_flops_per_token / t.flops_per_token)
    t.metrics.record(t.step, scalars=per_rank, **fields)
