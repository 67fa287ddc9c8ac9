"""Every layout the GPT trainer's options accept on this many processes, in one torchrun launch: the space
is read from the options themselves (the mesh's Layout dimensions, --pp_schedule's and --dtype's choices,
--parallel zero), so a dimension, a schedule or a type added there is in it. Each combination goes
through train.py's own parse_args: refused (one line, said as argparse says it) or trained for a few steps
by a Trainer into its own snapshot folder, which the test compares with one process's.

    torchrun --nproc-per-node W layout_matrix.py OUT MAX_DEGREE GLOBAL_BATCH STEPS -- TRAIN_ARGS...

STEPS: {"fp32": 3, "bf16": 20, ...}, steps by --dtype. Rank 0 prints one line per combination, its name,
then `trained`, the type of the residual stream between blocks in every process, the run's replica check,
its last validation loss and whether every process ran the after-backward hook once a micro-batch; or
`refused` and argparse's message. Started by tests/gpt/test_gpt_layouts.py."""

import contextlib
import io
import itertools
import json
import math
import os
import re
import sys

import config
import data
import parallel
import torch
import torch.distributed as dist
from failures import preempt
from parallel.dtensors import local
from parallel.mesh import Layout
from processes import all_ranks, setup_processes
from trainer import Trainer

DROPOUT = [0.0, 0.1]


def degrees(world, most):
    """Every assignment of degrees (each at most `most`) to the mesh's dimensions whose product is world."""
    sizes = [d for d in range(1, world + 1) if world % d == 0 and d <= most]
    for shape in itertools.product(sizes, repeat=len(Layout.NAMES)):
        if math.prod(shape) == world:
            yield dict(zip(Layout.NAMES, shape, strict=True))


def choices(option):
    parser = config.get_parser()
    return next(a.choices for a in parser._actions if option in a.option_strings)


def combinations(world, most, batch, steps):
    """(name, argv) of each combination; the global batch is the same in all. float32: every shape with
    every schedule and both --parallel choices; the 16-bit types pairwise: every shape, and each pipeline
    shape with one schedule in turn, so that each schedule meets each type (their 20 steps are the cost).
    --ac and --grad_accum join pairwise, not as a product: the j-th run of the k-th shape takes mode
    j + k and accumulation j + k in turn, so that every shape meets every value and every value every
    type; a pipeline accumulates with its micro-batches (one run says so: refused). --dropout 0 and 0.1
    join as well: a shape's float32 runs take 0.1 and 0 in turn, its 16-bit runs 0 but in the first shape
    (their 20 steps are the cost); one process, the reference, runs each with both."""
    dtypes = {}  # one name per type the choices resolve to here (auto: fp32 on a CPU)
    for name in sorted(choices("--dtype"), key=lambda n: n == "auto"):
        dtypes.setdefault(parallel.resolve_dtype(name, torch.device("cpu")), name)
    modes, pipelines = choices("--ac"), 0
    for k, shape in enumerate(degrees(world, most)):
        schedules = choices("--pp_schedule") if shape["pp"] > 1 else [None]
        turn = schedules[pipelines % len(schedules)]
        pipelines += shape["pp"] > 1
        dp = shape["dp_replicate"] * shape["dp_shard"]
        runs = itertools.product(dtypes.values(), schedules, (False, True))  # float32's first
        runs = [(s, zero, dtype) for dtype, s, zero in runs if dtype == dtypes[torch.float32] or s == turn]
        if shape["pp"] > 1:
            runs.append((turn, False, dtypes[torch.float32], "accum"))
        j = i = 0
        for schedule, zero, dtype, *accumulate in runs:
            ac = modes[(j + k) % len(modes)]
            accum = 2 if accumulate or (shape["pp"] == 1 and (j + k) % 2) else 1
            # dropout: a shape's float32 runs in turn, from 0.1 (in the first shape from 0); its 16-bit
            # runs (20 steps: the cost) 0.1 in the first shape alone
            fp32 = dtype == dtypes[torch.float32]
            drop = DROPOUT[(i + (k > 0)) % 2] if fp32 else DROPOUT[k == 0]
            i += fp32 and not zero
            j += not zero  # a zero run takes the next one's: zero stands beside replicas alone
            argv = [f"--{name}={size}" for name, size in shape.items()]
            argv += [f"--batch_size={batch // dp // accum}", f"--grad_accum={accum}"]
            argv += [f"--pp_microbatches={shape['pp']}", f"--ac={ac}"]
            argv += [] if schedule is None else [f"--pp_schedule={schedule}"]
            argv += ["--parallel=zero"] if zero else []
            argv += [f"--dtype={dtype}", f"--max_steps={steps[dtype]}", f"--eval_every={steps[dtype]}"]
            name = "x".join(f"{n}{s}" for n, s in shape.items() if s > 1) or "one"
            name += "".join(f"-{part}" for part in (schedule, zero and "zero", dtype) if part)
            # one process is the reference: each of its runs with and without dropout
            for value in DROPOUT if world == 1 else [drop]:
                yield f"{name}-ac_{ac}-accum{accum}-dropout{value}", [*argv, f"--dropout={value}"]


def parse(argv):
    """(args, None), or (None, the refusal's last line) as argparse says it."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return config.parse_args(argv)[1], None
    except SystemExit:
        return None, err.getvalue().strip().splitlines()[-1]


def main():
    out, most, batch, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
    common = sys.argv[sys.argv.index("--") + 1 :]
    os.environ.pop("TORCHELASTIC_ERROR_FILE", None)  # refusals as argparse says them alone, caught here
    rank, world, device = setup_processes(300)
    stop = preempt.StopRequest()
    corpus = None
    for name, argv in combinations(world, most, batch, steps):
        args, refusal = parse([*common, *argv, "--snapshot_path", os.path.join(out, name)])
        if refusal is not None:
            line = f"COMBO {name} refused {refusal}"
        else:
            if corpus is None:
                corpus = data.load_corpus(args.data, args.cache_dir, args.timeout, args.tokenizer)
            trainer = Trainer(args, corpus, None, rank, world, device)
            seen = set()  # the residual stream's type between blocks, from every block's output
            for block in trainer.raw.blocks.values():
                block.register_forward_hook(lambda m, i, o, seen=seen: seen.add(str(local(o).dtype)))
            backwards = []  # one call a micro-batch (memory.MemoryMeter's hook; under pp a private method's)
            trainer.parallel.after_backward.append(lambda backwards=backwards: backwards.append(1))
            said = io.StringIO()
            with contextlib.redirect_stdout(said):
                trainer.train(stop)
            replicas = said.getvalue().strip().splitlines()[-1] if rank == 0 else ""
            val = re.findall(r"^step \d+ \| val loss ([0-9.]+)$", said.getvalue(), re.M)[-1:]
            micro = args.pp_microbatches if args.layout.pp > 1 else args.grad_accum
            hooks = all(all_ranks(len(backwards) == args.max_steps * micro))
            residual = ",".join(sorted(set().union(*all_ranks(sorted(seen)))))
            line = f"COMBO {name} trained {residual} | {replicas} | val loss {''.join(val)} | "
            line += f"hooks once a micro-batch: {hooks}"
            del trainer
        if rank == 0:
            print(line, flush=True)
    dist.barrier()
    os._exit(0)  # as train.py ends (failure.leave): groups still held by DTensor's caches


if __name__ == "__main__":
    main()
