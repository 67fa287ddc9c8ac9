"""Memory per rank of the GPT trainer under every layout, next to what each should hold.

    python benchmarks/gpt_memory.py              # every layout on 4 processes, a few steps each
    python benchmarks/gpt_memory.py --ranks 2 --strategies ddp fsdp --steps 3 -- --n_layer 2
                                                 # after --: train.py's options

The layouts: each --parallel strategy (all processes along one mesh dimension), fsdp with 4 micro-batches
a step (ACCUMULATION: its gradients are counted after every micro-batch's backward, where they peak) and,
on 4 processes, the 2-D ones (LAYOUTS). Each trains for --steps steps on --ranks CPU processes (on a
machine with GPUs, one per GPU, 4 of them where there are more), and every rank reports the bytes of
its parameters, gradients and optimizer state (its local shards where a strategy shards them) and its
peak memory: peak RSS on CPUs, which includes torch itself and the corpus, or the CUDA allocator's peak on
GPUs. Prints the table, and writes memory.json, memory.md and memory.png (with matplotlib) under --out. A
strategy that fails is reported with the last line it printed; the exit status is then 1.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from gpt_throughput import TrainingFailed, run_training, strategies

REPO = Path(__file__).resolve().parents[1]
KINDS = ["params_bytes", "grads_bytes", "optimizer_bytes"]
# What each rank should hold, as a share of what a DDP rank holds (params, grads, optimizer state); None
# where it depends on the model's layout.
THEORY = {
    "ddp": ((1, 1, 1), "every rank holds everything"),
    "zero": ((1, 1, "1/N"), "optimizer state about 1/N (split by whole tensors)"),
    "fsdp": (("1/N", "1/N", "1/N"), "params, grads and optimizer state about 1/N"),
    "fsdp, grad_accum 4": (
        ("1/N", "1/N", "1/N"),
        "as fsdp: every micro-batch's gradients reduce-scattered, never whole",
    ),
    "tp": (("1/N", "1/N", "1/N"), "about 1/N: every matrix and embedding split, norms and row biases whole"),
    "pp": (None, "the layers of one stage"),
    "hsdp": ((0.5, 0.5, 0.5), "everything 1/2: sharded over dp_shard 2, replicated over dp_replicate 2"),
    "fsdp x tp": ((0.25, 0.25, 0.25), "about 1/4: split by tp 2, then by dp_shard 2; norms 1/2"),
    "pp x fsdp": (
        None,
        "one stage's layers, 1/2 of them; its gradients whole between the pipeline's micro-batches",
    ),
    "pp x ddp": (None, "one stage's layers, whole"),
}
# Accumulation, on any number of processes: the gradients between micro-batches.
ACCUMULATION = {"fsdp, grad_accum 4": ["--parallel", "fsdp", "--grad_accum", 4]}
# Layouts of two dimensions, for 4 processes: train.py's options for each.
LAYOUTS = {
    "hsdp": ["--dp_replicate", 2, "--dp_shard", 2],
    "fsdp x tp": ["--dp_shard", 2, "--tp", 2],
    "pp x fsdp": ["--pp", 2, "--dp_shard", 2],
    "pp x ddp": ["--pp", 2, "--dp_replicate", 2],
}


def layouts(ranks):
    """{name: train.py's options}: every --parallel strategy, fsdp with accumulation, and the 2-D layouts
    when ranks is 4."""
    one_d = {strategy: ["--parallel", strategy] for strategy in strategies()}
    return one_d | ACCUMULATION | (LAYOUTS if ranks == 4 else {})


def theory(strategy, ranks):
    shares, text = THEORY.get(strategy, (None, "no expectation recorded"))
    if shares is None:
        return text
    share = " / ".join(f"{1 / ranks:.2f}" if s == "1/N" else str(s) for s in shares)
    return f"{share}: {text}"


def measure(name, options, ranks, cpu, args, train_args, work):
    """Every rank's memory record, in rank order."""
    records, _ = run_training(
        "".join(c for c in name if c.isalnum()), ranks, 1, [*options, *train_args], work, steps=args.steps,
        cache_dir=args.cache_dir, limit=args.limit, cpu=cpu,
    )  # fmt: skip
    memory = sorted((r for r in records if "memory" in r), key=lambda r: r["rank"])
    if [r["rank"] for r in memory] != list(range(ranks)):
        raise TrainingFailed(f"memory records from ranks {[r['rank'] for r in memory]}, not 0..{ranks - 1}")
    return [r["memory"] for r in memory]


def markdown(results, ranks, device):
    def row(*cells):
        return "| " + " | ".join(map(str, cells)) + " |"

    peak = "peak RSS" if device == "cpu" else "CUDA peak allocated"
    lines = [
        row("layout", "rank", "params (bytes)", "grads (bytes)", "optimizer state (bytes)",
            f"{peak} (MiB)", "share of ddp's (measured)", "share of ddp's (theory)"),
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]  # fmt: skip
    ddp = results.get("ddp")
    for strategy, result in results.items():
        if "failed" in result:
            lines.append(row(strategy, "-", "-", "-", "-", "-", f"failed: {result['failed']}", ""))
            continue
        for rank, m in enumerate(result["ranks"]):
            shares = "-"
            if isinstance(ddp, dict) and "ranks" in ddp:  # every DDP rank holds the same
                shares = " / ".join(f"{m[k] / ddp['ranks'][0][k]:.2f}" for k in KINDS)
            bytes_ = [f"{m[k]:,}" for k in KINDS]
            lines.append(
                row(
                    strategy, rank, *bytes_, f"{m['peak_bytes'] / 2**20:.0f}", shares, theory(strategy, ranks)
                )
            )
    title = f"Memory per rank, {ranks} ranks on {device}; shares: params / grads / optimizer state."
    return title + "\n\n" + "\n".join(lines) + "\n"


def plot(results, ranks, device, path):
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = {s: r["ranks"] for s, r in results.items() if "ranks" in r}
    labels = [f"{s}\nrank {i}" for s, rows in done.items() for i in range(len(rows))]
    rows = [m for rows in done.values() for m in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(rows)), 4))
    bottom = [0.0] * len(rows)
    for kind, name in zip(KINDS, ["params", "grads", "optimizer state"], strict=True):
        values = [m[kind] / 2**20 for m in rows]
        left.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    left.set(title=f"held per rank ({ranks} ranks)", ylabel="MiB")
    left.legend(fontsize=8)
    right.bar(labels, [m["peak_bytes"] / 2**20 for m in rows], color="gray")
    right.set(title=f"peak per rank ({'RSS' if device == 'cpu' else 'CUDA allocated'})", ylabel="MiB")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--strategies", nargs="+", metavar="NAME",
        help="a subset of the layouts: train.py's --parallel choices, "
        + ", ".join(f"'{name}'" for name in ACCUMULATION)
        + " and, on 4 ranks, "
        + ", ".join(LAYOUTS),
    )  # fmt: skip
    p.add_argument(
        "--ranks", type=int, default=4, help="processes on CPUs (4); on GPUs, 4 or as many as there are"
    )
    p.add_argument("--steps", type=int, default=3, help="training steps per strategy (3)")
    p.add_argument("--cache_dir", default=None, help="corpus cache (default: train.py's)")
    p.add_argument("--limit", type=float, default=600, help="seconds one strategy's run may take (600)")
    p.add_argument("--out", type=Path, default=REPO / "bench-results", help="where the results go")
    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)  # after --: train.py's own options
    args, train_args = p.parse_args(argv[:split]), argv[split + 1 :]
    if args.steps <= 0 or args.limit <= 0 or args.ranks < 2:
        p.error("--steps and --limit must be positive, --ranks 2 or more")
    gpus = torch.cuda.device_count()
    ranks, device = (min(gpus, 4), "cuda") if gpus >= 2 else (args.ranks, "cpu")
    known = layouts(ranks)
    if ranks != 4 and not args.strategies:
        print(f"note: the 2-D layouts ({', '.join(LAYOUTS)}) need 4 ranks: left out on {ranks}", flush=True)
    chosen = args.strategies or list(known)
    unknown = [s for s in chosen if s not in known]
    if unknown:
        p.error(
            f"--strategies: unknown {unknown}; train.py's --parallel choices: {strategies()}"
            + ("" if ranks == 4 else f" (the 2-D layouts {list(LAYOUTS)} need 4 ranks)")
        )
    if args.cache_dir is None:
        from data import default_cache_dir

        args.cache_dir = default_cache_dir()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in chosen:
            try:
                ranks_memory = measure(
                    strategy, known[strategy], ranks, device == "cpu", args, train_args, Path(tmp)
                )
                results[strategy] = {"ranks": ranks_memory}
            except TrainingFailed as exc:
                results[strategy] = {"failed": str(exc)}
            status = results[strategy].get("failed")
            print(f"{strategy}: {'failed: ' + status if status else 'done'}", flush=True)
    table = markdown(results, ranks, device)
    print("\n" + table)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "ranks": ranks,
        "device": device,
        "steps": args.steps,
        "train_args": train_args,
        "results": results,
    }
    (args.out / "memory.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "memory.md").write_text(table)
    written = [
        args.out / "memory.json",
        args.out / "memory.md",
        plot(results, ranks, device, args.out / "memory.png"),
    ]
    print("wrote " + ", ".join(str(w) for w in written if w))
    return 1 if any("failed" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
