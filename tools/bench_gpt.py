"""Throughput of the GPT trainer: 2 DDP processes of 1 thread against one process of 2 threads, at the same
global batch, interleaved over rounds in rotating order. Prints tokens/s of each and their ratio.

    python tools/bench_gpt.py                      # the cpu preset, 3 rounds
    python tools/bench_gpt.py --rounds 5 --steps 100 --out bench-results/gpt.json
    python tools/bench_gpt.py -- --n_layer 2 --n_embd 32 --block_size 32    # options for train.py
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[1] / "examples" / "gpt" / "train.py"
VARIANTS = {
    # name: (processes, threads per process)
    "one_process_2_threads": (1, 2),
    "ddp_2_processes_1_thread": (2, 1),
}


def run_variant(name, args, train_args, work):
    procs, threads = VARIANTS[name]
    metrics = work / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable]
    if procs > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"]
    cmd += [TRAIN, "--max_steps", args.steps, "--batch_size", args.global_batch // procs]
    cmd += ["--log_every", args.log_every, "--eval_every", args.steps, "--eval_samples", 16]
    cmd += ["--sample_chars", 0, "--save_every", args.steps, "--metrics_path", metrics]
    cmd += ["--snapshot_path", work / f"{name}.pt", "--cache_dir", args.cache_dir, *train_args]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=args.limit)
    (work / f"{name}.pt").unlink(missing_ok=True)
    if proc.returncode != 0:
        sys.exit(f"{name} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][1:]  # the first interval warms up
    return statistics.mean(rates)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="each variant once per round (3)")
    p.add_argument("--steps", type=int, default=60, help="steps per run (60)")
    p.add_argument("--log_every", type=int, default=10, help="steps per measured interval (10)")
    p.add_argument("--global_batch", type=int, default=64, help="sequences per step in all (64)")
    p.add_argument("--cache_dir", default=None, help="corpus cache (default: train.py's)")
    p.add_argument("--limit", type=float, default=900, help="seconds one run may take (900)")
    p.add_argument("--out", help="also write the results as JSON here")
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
        sys.path.insert(0, str(TRAIN.parent))
        from config import default_cache_dir

        args.cache_dir = default_cache_dir()
    names = list(VARIANTS)
    results = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]  # rotate who goes first
            for name in order:
                results[name].append(run_variant(name, args, train_args, Path(tmp)))
            ratio = results[names[1]][-1] / results[names[0]][-1]
            print(
                f"round {r + 1}: "
                + ", ".join(f"{n} {results[n][-1]:.0f}" for n in names)
                + f", ratio {ratio:.3f}"
            )
    print(f"global batch {args.global_batch}, {args.steps} steps per run, {args.rounds} round(s); tokens/s:")
    for name in names:
        values = results[name]
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        print(f"  {name:26s} {statistics.mean(values):10.0f} ± {std:.0f}")
    ratio = statistics.mean(results[names[1]]) / statistics.mean(results[names[0]])
    print(f"  ratio ddp/one (goal >= 0.95) {ratio:.3f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        report = {
            "settings": {**vars(args), "train_args": train_args},
            "tokens_per_s": results,
            "ratio": ratio,
        }
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
