"""All-reduce bandwidth per message size, next to a copy in memory on the same machine.

    torchrun --standalone --nproc-per-node=2 benchmarks/allreduce.py            # gloo on CPUs, NCCL on GPUs
    torchrun --standalone --nproc-per-node=2 benchmarks/allreduce.py --max_bytes 1M --iter_bytes 64M

For each size (float32 messages, doubling from --min_bytes to --max_bytes) every rank times --iters
all-reduces after --warmup ones; the slowest rank's mean time counts. Reported as
    algbw = bytes / time                       what one rank sees
    busbw = algbw * 2 (n - 1) / n              what each link carries in a ring all-reduce, comparable over n
for dist.all_reduce and for a naive all-reduce (reduce to rank 0, then broadcast from it), and next to the
copy bandwidth of one tensor into another on rank 0 (memory on CPUs, device memory on GPUs), the limit that a
single-machine all-reduce cannot beat. A check all-reduce per size counts wrong elements (#wrong).
"""

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text):
    """'4K', '256M' or '1024' as a number of bytes."""
    unit = text[-1].upper() if text[-1].upper() in UNITS else ""
    return int(float(text[: len(text) - len(unit)]) * UNITS[unit])


def human(size):
    for unit in ("G", "M", "K"):
        if size >= UNITS[unit]:
            return f"{size / UNITS[unit]:g}{unit}"
    return str(size)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(op, iters, warmup, device):
    """Mean seconds per call of op on this rank, after warm-up, all ranks starting together."""
    for _ in range(warmup):
        op()
    synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        op()
    synchronize(device)
    return (time.perf_counter() - start) / iters


def slowest(seconds, device):
    """The largest time over all ranks: a collective is done when its last rank is."""
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def naive_all_reduce(tensor):
    """Everything to rank 0, then everything back: rank 0's links carry all the traffic."""
    dist.reduce(tensor, dst=0)
    dist.broadcast(tensor, src=0)


def count_wrong(all_reduce, numel, device):
    """All-reduce rank+1 from every rank; every element must be n(n+1)/2. Returns the number that are not."""
    n = dist.get_world_size()
    tensor = torch.full((numel,), float(dist.get_rank() + 1), device=device)
    all_reduce(tensor)
    wrong = torch.tensor([(tensor != n * (n + 1) / 2).sum().item()], device=device)
    dist.all_reduce(wrong)
    return int(wrong.item())


def copy_seconds(numel, iters, warmup, device):
    """Seconds to copy one float32 tensor into another, on rank 0 while the others wait."""
    seconds = 0.0
    if dist.get_rank() == 0:
        src, dst = torch.ones(numel, device=device), torch.empty(numel, device=device)
        for _ in range(warmup):
            dst.copy_(src)
        synchronize(device)
        start = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        synchronize(device)
        seconds = (time.perf_counter() - start) / iters
    dist.barrier()
    return seconds


def measure(size, args, device):
    numel = max(1, size // 4)
    size = numel * 4
    iters = max(args.min_iters, min(args.max_iters, args.iter_bytes // size))
    tensor = torch.zeros(numel, device=device)  # zeros stay zeros: the timing loop never overflows
    n = dist.get_world_size()
    row = {"bytes": size, "count": numel, "iters": iters}
    for name, op in (("all_reduce", dist.all_reduce), ("naive", naive_all_reduce)):
        seconds = slowest(timed(lambda op=op: op(tensor), iters, args.warmup, device), device)
        algbw = size / seconds / 1e9
        row[name] = {
            "time_us": seconds * 1e6,
            "algbw_GBps": algbw,
            "busbw_GBps": algbw * 2 * (n - 1) / n,
            "wrong": count_wrong(op, numel, device),
        }
    copy = copy_seconds(numel, iters, args.warmup, device)
    row["copy_GBps"] = size / copy / 1e9 if copy else None  # bytes copied per second: read + write is twice
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min_bytes", type=parse_bytes, default="1K", help="smallest message (default 1K)")
    parser.add_argument(
        "--max_bytes", type=parse_bytes, default="256M", help="largest message (default 256M)"
    )
    parser.add_argument("--iter_bytes", type=parse_bytes, default="512M", help="bytes to move per size")
    parser.add_argument("--min_iters", type=int, default=3, help="timed calls per size, at least")
    parser.add_argument("--max_iters", type=int, default=200, help="timed calls per size, at most")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per size first")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a collective may wait")
    parser.add_argument("--out", type=Path, help="also write the rows as JSON to this file")
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:
        parser.error(
            "start me with torchrun, e.g. torchrun --standalone --nproc-per-node=2 benchmarks/allreduce.py"
        )
    if not 0 < args.min_bytes <= args.max_bytes:
        parser.error("need 0 < --min_bytes <= --max_bytes")

    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if gpu else "gloo", timeout=timedelta(seconds=args.timeout))
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    rank, n = dist.get_rank(), dist.get_world_size()
    where = (
        torch.cuda.get_device_name(device) if gpu else f"CPU, {torch.get_num_threads()} thread(s) per rank"
    )
    if rank == 0:
        print(
            f"# all-reduce of float32, {n} ranks, backend {dist.get_backend()}, {where}, "
            f"torch {torch.__version__}"
        )
        print(
            "# busbw = algbw * 2(n-1)/n; copy: one tensor into another on rank 0, bytes/s (read+write is 2x)"
        )
        op = f" {'time us':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6} |"
        print(f"#{'':>24} |{'dist.all_reduce (GB/s)':^35}|{'reduce + broadcast (GB/s)':^35}|")
        print(f"{'size':>7} {'count':>10} {'iters':>5} |{op}{op} copy GB/s")
    rows = []
    size = args.min_bytes
    while size <= args.max_bytes:
        row = measure(size, args, device)
        rows.append(row)
        if rank == 0:
            cells = [f"{human(row['bytes']):>7} {row['count']:>10} {row['iters']:>5} |"]
            for name in ("all_reduce", "naive"):
                r = row[name]
                bandwidth = f"{r['algbw_GBps']:>7.3f} {r['busbw_GBps']:>7.3f}"
                cells.append(f" {r['time_us']:>10.1f} {bandwidth} {r['wrong']:>6} |")
            cells.append(f" {row['copy_GBps']:>8.2f}")
            print("".join(cells), flush=True)
        size *= 2
    if rank == 0:
        last = rows[-1]
        print(
            f"# at {human(last['bytes'])}: all-reduce busbw {last['all_reduce']['busbw_GBps']:.3f} GB/s, "
            f"naive {last['naive']['busbw_GBps']:.3f} GB/s, copy {last['copy_GBps']:.2f} GB/s"
        )
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            meta = {"ranks": n, "backend": dist.get_backend(), "device": where, "torch": torch.__version__}
            args.out.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    dist.destroy_process_group()
    if rank == 0 and any(row[name]["wrong"] for row in rows for name in ("all_reduce", "naive")):
        raise SystemExit("error: some all-reduce results were wrong (#wrong column)")


if __name__ == "__main__":
    main()
