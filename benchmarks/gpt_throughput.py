"""Throughput of the GPT trainer: 2 DDP processes of 1 thread against one process of 2 threads, at the same
global batch, interleaved over rounds in rotating order. Prints tokens/s of each and their ratio.

    python benchmarks/gpt_throughput.py                      # the cpu preset, 3 rounds
    python benchmarks/gpt_throughput.py --rounds 5 --steps 100 --out bench-results/gpt.json
    python benchmarks/gpt_throughput.py -- --n_layer 2 --n_embd 32 --block_size 32    # options for train.py
    python benchmarks/gpt_throughput.py --strategies  # every --parallel strategy on 2 CPU ranks, vs ddp
    python benchmarks/gpt_throughput.py --strategies ddp zero
    python benchmarks/gpt_throughput.py --shards  # batches read from memory-mapped shards vs --in_memory
    python benchmarks/gpt_throughput.py --metrics  # TensorBoard and per-process times on vs JSON lines alone
    python benchmarks/gpt_throughput.py --nanogpt --rounds 5  # against nanoGPT's loop (nanogpt_loop.py)

--nanogpt: the cpu preset's shape (4 layers, width 128, context 128) trained by train.py (in float32, as
nanoGPT on a CPU, and with --dtype bf16 where the CPU has it in hardware) and by nanoGPT's loop, each on 2
DDP processes of 1 thread, from one folder of nanoGPT's character-level data.
The strategies run at the same global batch: a strategy that splits the model rather than the data gets a
larger batch per process (the layout's dp says how many data-parallel shares there are).
benchmarks/gpt_memory.py starts its trainings through run_training() below.
"""

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

TRAIN = Path(__file__).resolve().parents[1] / "examples" / "gpt" / "train.py"
NANOGPT = Path(__file__).resolve().parent / "nanogpt_loop.py"
NANOGPT_LINE = re.compile(r"^iter \d+: loss \S+, time ([\d.]+)ms$", re.MULTILINE)
sys.path.insert(0, str(TRAIN.parent))  # config: train.py's options and layouts
# what starts a run of more than one process, given --nproc-per-node=N (--launcher: another command)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
VARIANTS = {
    # name: (processes, threads per process)
    "one_process_2_threads": (1, 2),
    "ddp_2_processes_1_thread": (2, 1),
}
# --nanogpt on a CPU without bf16 hardware (model.cpu_emulates): the trainer's bf16 run is left out
BF16_EMULATED = (
    "this CPU emulates bf16 (no AMX, AVX-512 BF16 nor AVX-NE-CONVERT): 10x float32's step on an AVX2 EPYC"
)
GLOBAL_BATCH_RE = re.compile(r"\| global batch (\d+) x")
# an exception's last line (a worker's carries torchrun's "[rankN]: " prefix), an "error: ..." message (in
# torchrun's closing summary, the message of the trainer's failures.failure.Failed), a C++ exception's
# what(), or else torchrun's summary of a worker's exit code (its ChildFailedError says less)
ERROR_RE = re.compile(
    r"^(?:\[rank\d+\]: |\s*traceback : )?(?:failures\.failure\.Failed: )?"
    r"((?!\S*ChildFailedError)[\w.]+(?:Error|Exception): .*|.*\b(?:error|what\(\)): .*)$"
)
EXITCODE_RE = re.compile(r"^(exitcode\s*: -?\d+)")


class TrainingFailed(RuntimeError):
    """A failed training run: the message is its error's last line, .output the end of its output."""

    def __init__(self, message, output=""):
        super().__init__(message)
        self.output = output[-3000:]


def strategies():
    """The --parallel choices of train.py, in the order it lists them."""
    from config import get_parser

    return list(next(a for a in get_parser()._actions if a.dest == "parallel").choices)


def data_parallel_shares(strategy, procs, train_args):
    """How many shares of each global batch `procs` processes of this strategy take."""
    from config import parse_args

    with mock.patch.dict(os.environ, {"WORLD_SIZE": str(procs)}):  # checked for the world it will run in
        _, args = parse_args(["--parallel", strategy, *train_args])
    return args.layout.dp


def run_training(
    name, procs, threads, train_args, work, *, steps, cache_dir, limit, log_every=None, cpu=True,
    launcher=TORCHRUN,
):  # fmt: skip
    """train.py for `steps` steps on `procs` processes (the launcher when more than one), on the CPU unless
    cpu is False: its metrics records and its output. A failed run raises TrainingFailed (its error's last
    line)."""
    metrics, snapshot = work / f"{name}.jsonl", work / f"{name}-snapshot"  # a directory
    metrics.unlink(missing_ok=True)
    cmd = [*launcher, f"--nproc-per-node={procs}"] if procs > 1 else [sys.executable]
    cmd += [TRAIN, "--max_steps", steps, "--log_every", log_every or steps, "--eval_every", steps]
    cmd += ["--eval_samples", 16, "--sample_chars", 0, "--save_every", steps, "--metrics_path", metrics]
    cmd += ["--snapshot_path", snapshot, "--cache_dir", cache_dir, *train_args]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), **({"CUDA_VISIBLE_DEVICES": ""} if cpu else {})}
    try:
        proc = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as exc:
        raise TrainingFailed(f"no end within {limit:.0f} s") from exc
    finally:
        shutil.rmtree(snapshot, ignore_errors=True)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        lines = [line.strip() for line in output.splitlines() if line.strip()]
        errors = [m.group(1) for m in map(ERROR_RE.match, lines) if m]
        errors = errors or [f"a worker's {m.group(1)}" for m in map(EXITCODE_RE.match, lines) if m]
        raise TrainingFailed(f"exit {proc.returncode}: {(errors or lines or ['no output'])[-1]}", output)
    return [json.loads(line) for line in metrics.read_text().splitlines()], output


def run_nanogpt(data, global_batch, *, steps, log_every, limit, launcher=TORCHRUN):
    """benchmarks/nanogpt_loop.py on 2 processes of 1 thread, in the cpu preset's shape: records as
    run_training's, the tokens/s of each log_every iterations from the times its rank 0 prints."""
    from presets import PRESETS

    shape = {key: PRESETS["cpu"][key] for key in ("n_layer", "n_head", "n_embd", "block_size")}
    cmd = [*launcher, "--nproc-per-node=2", NANOGPT, "--data", data, "--max_iters", steps]
    cmd += ["--batch_size", global_batch // 2, "--gradient_accumulation_steps", 2]
    cmd += [item for key, value in shape.items() for item in (f"--{key}", value)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    try:
        proc = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as exc:
        raise TrainingFailed(f"no end within {limit:.0f} s") from exc
    seconds = [float(ms) / 1000 for ms in NANOGPT_LINE.findall(proc.stdout)]
    if proc.returncode != 0 or len(seconds) != steps:
        message = f"nanogpt_loop.py: exit {proc.returncode}, {len(seconds)} of {steps} iterations timed"
        raise TrainingFailed(message, proc.stdout + proc.stderr)
    tokens = global_batch * shape["block_size"]
    intervals = [seconds[i : i + log_every] for i in range(0, steps, log_every)]
    return [{"tokens_per_s": tokens * len(chunk) / sum(chunk)} for chunk in intervals]


def tokens_per_s(records):
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][1:]  # the first interval warms up
    return statistics.mean(rates)


def plan(args, train_args, parser):
    """{variant: (processes, threads, extra train.py options)} and the variant the others are divided by."""
    if args.nanogpt:  # the trainer's --data (the folder nanoGPT's loop reads too) comes in main
        import torch
        from model import cpu_emulates

        trainer = ["--model", "cpu", "--batch_size", args.global_batch // 2]
        variants = {"nanogpt": (2, 1, []), "trainer": (2, 1, trainer)}
        if cpu_emulates(torch.bfloat16):  # a step 10 times float32's: nothing to learn from timing it
            print(f"trainer_bf16 left out: {BF16_EMULATED}")
        else:  # autocast on the CPU, which nanoGPT keeps for GPUs
            variants["trainer_bf16"] = (2, 1, [*trainer, "--dtype", "bf16"])
        return variants, "nanogpt"
    if args.shards:  # 2 DDP processes either way: the data path is the only difference
        batch = ["--batch_size", args.global_batch // 2]
        return {"in_memory": (2, 1, [*batch, "--in_memory"]), "shards": (2, 1, batch)}, "in_memory"
    if args.metrics:  # the JSON lines either way (the bench reads them); off: no event files, no timing
        batch = ["--batch_size", args.global_batch // 2]
        off = [*batch, "--no_tensorboard", "--slow_factor", "0"]
        return {"metrics_off": (2, 1, off), "metrics_on": (2, 1, batch)}, "metrics_off"
    if args.strategies is None:
        batch = {name: ["--batch_size", args.global_batch // procs] for name, (procs, _) in VARIANTS.items()}
        variants = {name: (*VARIANTS[name], batch[name]) for name in VARIANTS}
        return variants, "one_process_2_threads"
    known = strategies()
    chosen = args.strategies or known
    unknown = [s for s in chosen if s not in known]
    if unknown:
        parser.error(f"--strategies: unknown {unknown}; train.py's --parallel choices: {known}")
    if "ddp" not in chosen:
        chosen = ["ddp", *chosen]  # the baseline
    variants = {}
    for s in chosen:
        shares = data_parallel_shares(s, 2, train_args)
        if args.global_batch % shares:
            parser.error(f"--global_batch {args.global_batch} does not split into {shares} shares ({s})")
        batch = ["--batch_size", args.global_batch // shares, "--parallel", s]
        variants[s] = (2, 1, batch)
    return variants, "ddp"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="each variant once per round (3)")
    p.add_argument("--steps", type=int, default=60, help="steps per run (60)")
    p.add_argument("--log_every", type=int, default=10, help="steps per measured interval (10)")
    p.add_argument("--global_batch", type=int, default=64, help="sequences per step in all (64)")
    p.add_argument(
        "--strategies", nargs="*", metavar="NAME",
        help="compare --parallel strategies at 2 CPU ranks instead (none named: all of them)",
    )  # fmt: skip
    p.add_argument(
        "--shards", action="store_true",
        help="compare the data paths instead: memory-mapped shards against the corpus in memory (2 ranks)",
    )  # fmt: skip
    p.add_argument(
        "--metrics", action="store_true",
        help="compare TensorBoard event files and per-process times against the JSON lines alone (2 ranks)",
    )  # fmt: skip
    p.add_argument(
        "--nanogpt", action="store_true",
        help="compare train.py with nanoGPT's loop (benchmarks/nanogpt_loop.py), the cpu preset's shape",
    )  # fmt: skip
    p.add_argument("--cache_dir", default=None, help="corpus cache (default: train.py's)")
    p.add_argument("--limit", type=float, default=900, help="seconds one run may take (900)")
    p.add_argument("--out", help="also write the results as JSON here")
    p.add_argument(
        "--launcher", type=shlex.split, default=TORCHRUN, metavar="COMMAND",
        help="what starts a run's processes, given --nproc-per-node=N (torchrun --standalone)",
    )  # fmt: skip
    args, train_args = p.parse_known_args()
    train_args = [a for a in train_args if a != "--"]
    for key in ("rounds", "steps", "log_every", "global_batch", "limit"):
        if getattr(args, key) <= 0:
            p.error(f"--{key} must be positive")
    if args.steps < 2 * args.log_every:
        p.error("--steps must be at least twice --log_every: the first interval is left out as warm-up")
    if args.global_batch % 2:
        p.error("--global_batch must be even, to split between 2 processes")
    if args.cache_dir is None:
        from data import default_cache_dir

        args.cache_dir = default_cache_dir()
    if sum([args.shards, args.metrics, args.nanogpt, args.strategies is not None]) > 1:
        p.error("--shards, --metrics, --nanogpt and --strategies are different comparisons: give one")
    if args.nanogpt and train_args:
        p.error(f"--nanogpt compares the cpu preset's shape: no options for train.py, got {train_args}")
    variants, baseline = plan(args, train_args, p)
    names = list(variants)
    results, failed = {name: [] for name in names}, {}
    with tempfile.TemporaryDirectory() as tmp:
        nanogpt_data = Path(tmp) / "nanogpt-data"
        if args.nanogpt:  # one folder of nanoGPT's data for both
            import nanogpt_loop

            nanogpt_loop.prepare(nanogpt_data)
            for name in names:
                if name != "nanogpt":  # the trainer's runs
                    variants[name][2].extend(["--data", nanogpt_data])
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]  # rotate who goes first
            for name in (n for n in order if n not in failed):
                procs, threads, extra = variants[name]
                try:
                    if name == "nanogpt":
                        records = run_nanogpt(
                            nanogpt_data, args.global_batch, steps=args.steps,
                            log_every=args.log_every, limit=args.limit, launcher=args.launcher,
                        )  # fmt: skip
                        results[name].append(tokens_per_s(records))
                        continue
                    records, output = run_training(
                        name, procs, threads, [*extra, *train_args], Path(tmp), steps=args.steps,
                        log_every=args.log_every, cache_dir=args.cache_dir, limit=args.limit,
                        launcher=args.launcher,
                    )  # fmt: skip
                except TrainingFailed as exc:
                    if args.strategies is None or name == baseline:
                        sys.exit(f"{exc.output}\n{name} failed: {exc}")
                    failed[name] = str(exc)
                    print(f"round {r + 1}: {name} failed: {exc}")
                    continue
                batch = int(GLOBAL_BATCH_RE.search(output).group(1))
                if batch != args.global_batch:
                    sys.exit(f"{name} ran at global batch {batch}, not {args.global_batch}")
                results[name].append(tokens_per_s(records))
            done = [n for n in names if n not in failed]
            ratios = [
                f"{n}/{baseline} {results[n][-1] / results[baseline][-1]:.3f}" for n in done if n != baseline
            ]
            print(f"round {r + 1}: " + ", ".join([f"{n} {results[n][-1]:.0f}" for n in done] + ratios))
    report(args, train_args, names, baseline, results, failed)


def report(args, train_args, names, baseline, results, failed):
    print(f"global batch {args.global_batch}, {args.steps} steps per run, {args.rounds} round(s); tokens/s:")
    for name in names:
        values = results[name]
        if name in failed:
            print(f"  {name:26s} failed: {failed[name]}")
            continue
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        print(f"  {name:26s} {statistics.mean(values):10.0f} ± {std:.0f}")
    base = statistics.mean(results[baseline])
    ratios = {n: statistics.mean(results[n]) / base for n in names if n != baseline and n not in failed}
    if args.nanogpt:  # nanoGPT in float32 (its autocast is for GPUs): the trainer so, and in bf16
        for name, says in (("trainer", "float32 both"), ("trainer_bf16", "goal >= 1.05")):
            if name not in results:
                print(f"  ratio {name}/nanogpt: not run, {BF16_EMULATED}")
                continue
            spread = [t / n for t, n in zip(results[name], results["nanogpt"], strict=True)]
            print(
                f"  ratio {name}/nanogpt ({says}) {ratios[name]:.3f}; within a round: median "
                f"{statistics.median(spread):.3f}, {min(spread):.3f}-{max(spread):.3f} "
                f"over {len(spread)} rounds"
            )
        ratio = ratios["trainer"]
    elif args.shards:
        ratio = ratios["shards"]
        print(f"  ratio shards/in_memory (goal >= 0.98) {ratio:.3f}")
    elif args.metrics:
        ratio = ratios["metrics_on"]
        print(f"  ratio metrics_on/metrics_off (goal >= 0.99) {ratio:.3f}")
    elif args.strategies is None:
        ratio = ratios["ddp_2_processes_1_thread"]
        print(f"  ratio ddp/one (goal >= 0.95) {ratio:.3f}")
    else:
        print(
            "tokens/s of each strategy / ddp's, 2 ranks; on 2 CPU cores these show overheads, not speedups:"
        )
        for name, value in ratios.items():
            print(f"  {name}/ddp {value:.3f}")
        if not ratios:
            print("  (ddp alone ran: nothing to compare)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        out = {"settings": {**vars(args), "train_args": train_args}, "tokens_per_s": results}
        if args.nanogpt:
            out["ratio_bf16"] = ratios.get("trainer_bf16")  # None where the CPU emulates bf16
        out.update(
            {"ratio": ratio}
            if args.strategies is None or args.shards or args.metrics
            else {"ratio_to_ddp": ratios, "failed": failed}
        )
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
