"""Causal attention on the CPU, forward and backward, on inputs in bf16 and in fp16: computed in their
type, or cast to float32 and back (as the GPT's attention does where model.py's attends_in_float32
says so), at head widths 32 (the cpu preset's) and 64 (mini's and
GPT-2's) and a range of lengths, the same tokens per call. Prints milliseconds per call and each type's
time over its cast's.

    python benchmarks/cpu_attention.py                      # 1 thread, 5 rounds
    python benchmarks/cpu_attention.py --threads 2 --lengths 128 1024 --rounds 9
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))
from model import attends_in_float32

HEADS = 4
TYPES = [torch.bfloat16, torch.float16]
# name: (the inputs' type, the type attention computes in)
KINDS = {
    "bf16": (torch.bfloat16, torch.bfloat16),
    "bf16_cast": (torch.bfloat16, torch.float32),
    "fp16": (torch.float16, torch.float16),
    "fp16_cast": (torch.float16, torch.float32),
}


def attention(shape, dtype, compute, generator):
    """One forward and backward of causal attention on random inputs of this shape and type, computed in
    `compute`: seconds."""
    q, k, v = (torch.randn(shape, generator=generator).to(dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(shape, generator=generator).to(dtype)
    start = time.perf_counter()
    y = F.scaled_dot_product_attention(q.to(compute), k.to(compute), v.to(compute), is_causal=True)
    y.to(dtype).backward(grad)
    return time.perf_counter() - start


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    p.add_argument("--widths", type=int, nargs="+", default=[32, 64], help="per head (32 64)")
    p.add_argument("--tokens", type=int, default=8192, help="per call: batch = tokens / length (8192)")
    p.add_argument("--rounds", type=int, default=5, help="each type once per round; the median (5)")
    p.add_argument("--threads", type=int, default=1, help="torch's threads (1, as each DDP process)")
    args = p.parse_args(argv)
    if min(args.lengths + args.widths + [args.rounds, args.threads]) <= 0:
        p.error("--lengths, --widths, --rounds and --threads must be positive")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return table(args)
    finally:
        torch.set_num_threads(threads)  # as it was, for a caller in the same process


def table(args):
    """Times each kind at each width and length, printing a row each: the rows."""
    generator = torch.Generator().manual_seed(0)
    print(f"{args.threads} thread(s), {HEADS} heads, {args.tokens} tokens a call, median of {args.rounds}")
    print("width length |  bf16  cast  fp16  cast (ms) | bf16/cast fp16/cast | the GPT's: bf16 fp16")
    rows = []
    for width in args.widths:
        for length in args.lengths:
            shape = (max(1, args.tokens // length), HEADS, length, width)
            times = {name: [] for name in KINDS}
            for dtype, compute in KINDS.values():  # one untimed call each first
                attention(shape, dtype, compute, generator)
            for _ in range(args.rounds):
                for name, (dtype, compute) in KINDS.items():
                    times[name].append(attention(shape, dtype, compute, generator))
            ms = {name: 1000 * statistics.median(values) for name, values in times.items()}
            runs = [
                "cast" if attends_in_float32(torch.empty(0, 0, length, width, dtype=t)) else "own"
                for t in TYPES
            ]
            print(
                f"{width:5d} {length:6d} | {ms['bf16']:5.1f} {ms['bf16_cast']:5.1f} {ms['fp16']:5.1f} "
                f"{ms['fp16_cast']:5.1f}      | {ms['bf16'] / ms['bf16_cast']:9.2f} "
                f"{ms['fp16'] / ms['fp16_cast']:9.2f} | {runs[0]:>4s} {runs[1]:>4s}"
            )
            rows.append({"width": width, "length": length, "ms": ms})
    return rows


if __name__ == "__main__":
    main()
