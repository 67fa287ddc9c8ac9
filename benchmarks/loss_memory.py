"""Peak memory of the GPT's loss (the head and the cross-entropy, forward and backward) on the CPU: the whole
logits at once, as model.py computed it before (cross_entropy), against chunks of positions
(chunked_cross_entropy), in float32, under bf16 autocast, and with the head's weight in bf16 as FSDP2
gathers it under --dtype bf16 (bf16-weight).

    python benchmarks/loss_memory.py        # GPT-2's vocabulary (50257, padded 50304), 8 x 1024 tokens
    python benchmarks/loss_memory.py --vocab 4000 --tokens 4096 --width 16 --chunk 256   # seconds
    python benchmarks/loss_memory.py --width 16   # bf16 on a CPU without AVX-512: its matmuls are slow

Each run (a way and a dtype) is a fresh process: it makes the final norm's output (tokens x width), the head's
weight and frozen padding bias and the targets, runs the loss once on 64 positions (kernels loaded), then
once on all of them; its peak is the rise of its peak RSS (ru_maxrss) over that second run, gradients of x
and of the weight included, and what it keeps is the rise of its RSS from before that run's forward to
its end, before backward: what the loss holds while the rest of the model runs its backward (or, in a
pipeline, while other micro-batches run their forward). Prints one table, with the float32 logits' size
beside it for reading. The logits' size does not depend on the width, the time does: a CPU without
AVX-512 multiplies bf16 matrices about 100 times slower than float32 ones (GPT-2's width, 768: hours a
bf16 run).
"""

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))
from model import GPTConfig, chunked_cross_entropy, cross_entropy, padding_bias

WAYS = ["whole", "chunks"]


def peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def loss_of(way, x, weight, bias, targets, chunk):
    if way == "whole":
        return cross_entropy(F.linear(x, weight, bias), targets)
    return chunked_cross_entropy(x, weight, bias, targets, chunk)


def measure(way, dtype, args):
    """One run, in this process: {peak_mib, seconds, loss}."""
    cfg = GPTConfig(vocab_size=args.vocab)
    torch.manual_seed(0)
    # made in place: no temporary raises the peak before the measured run
    x = torch.randn(args.tokens, args.width).requires_grad_()
    weight = torch.empty(cfg.padded_vocab, args.width).normal_(0.0, 0.02)
    weight = weight.to(torch.bfloat16 if dtype == "bf16-weight" else torch.float32).requires_grad_()
    bias = padding_bias((cfg.padded_vocab,), cfg)
    targets = torch.randint(args.vocab, (args.tokens,))
    results = []
    for n in (64, args.tokens):  # the first: kernels and threads started outside the measured run
        x.grad = weight.grad = None
        before, start, held = peak_mib(), time.perf_counter(), rss_mib()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype != "fp32"):
            loss = loss_of(way, x[:n], weight, bias, targets[:n], args.chunk)
        kept = rss_mib() - held
        loss.backward()
        seconds = time.perf_counter() - start
        results.append({"peak_mib": peak_mib() - before, "kept_mib": kept, "seconds": seconds})
    return {**results[-1], "loss": loss.item()}


def markdown(rows, args, cfg):
    logits_mib = args.tokens * cfg.padded_vocab * 4 / 2**20
    lines = [
        f"{date.today()}, {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}: `python benchmarks/loss_memory.py {' '.join(sys.argv[1:])}`".rstrip(),
        f"({args.tokens} tokens, width {args.width}, vocabulary {args.vocab} padded to {cfg.padded_vocab}; "
        f"the float32 logits: {logits_mib:,.0f} MiB)",
        "",
        f"| dtype | whole logits: peak, kept (MiB) | chunks of {args.chunk}: peak, kept (MiB) "
        "| seconds, whole / chunks | loss, whole / chunks |",
        "|---|---:|---:|---:|---:|",
    ]
    for dtype, row in rows.items():
        whole, chunks = row["whole"], row["chunks"]
        peaks = " | ".join(f"{r['peak_mib']:,.0f}, {r['kept_mib']:,.0f}" for r in (whole, chunks))
        seconds = f"{whole['seconds']:.1f} / {chunks['seconds']:.1f}"
        lines.append(f"| {dtype} | {peaks} | {seconds} | {whole['loss']:.5f} / {chunks['loss']:.5f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=50257, help="vocabulary, padded as the GPT pads it (50257)")
    p.add_argument("--tokens", type=int, default=8 * 1024, help="positions: batch x length (8192)")
    p.add_argument("--width", type=int, default=768, help="n_embd (768, GPT-2 small's)")
    p.add_argument("--chunk", type=int, default=1024, help="positions per chunk (1024, the GPT's loss_chunk)")
    dtypes = ["fp32", "bf16", "bf16-weight"]
    p.add_argument("--dtypes", nargs="+", choices=dtypes, default=dtypes, help="all three")
    p.add_argument("--one", nargs=2, metavar=("WAY", "DTYPE"), help=argparse.SUPPRESS)  # a child's run
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(measure(*args.one, args)), flush=True)
        return 0
    rows = {dtype: {} for dtype in args.dtypes}
    options = ["--vocab", args.vocab, "--tokens", args.tokens, "--width", args.width, "--chunk", args.chunk]
    for dtype in args.dtypes:
        for way in WAYS:  # one at a time: each run's memory alone on the machine
            cmd = [sys.executable, __file__, *map(str, options), "--one", way, dtype]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rows[dtype][way] = json.loads(out.splitlines()[-1])
            print(f"{dtype} {way}: {rows[dtype][way]}", flush=True)
    print("\n" + markdown(rows, args, GPTConfig(vocab_size=args.vocab)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
