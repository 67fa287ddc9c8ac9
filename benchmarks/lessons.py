"""Measure the examples side by side: every launcher on the same workloads, interleaved and repeated.

    python benchmarks/lessons.py  # quick: a few minutes on 2 cores (what `make bench` runs)
    python benchmarks/lessons.py --full               # longer epochs, more samples, more repeats
    python benchmarks/lessons.py --workloads tiny --repeats 5 --variants plain tutorial

Every variant but the tutorial's trains the same model from the same seed with the same global batch, so
their loss curves should coincide; `tutorial` (benchmarks/tutorial_loop.py, tiny workload only) is the
upstream tutorial's loop on its own random data, the baseline of plain/tutorial, and `tutorial_mse` the same
loop with the lessons' loss, for a like-for-like plain/tutorial_mse. An epoch's samples/s is measured here,
the same way for every variant: its samples over the time between the arrivals of rank 0's epoch lines on
the process's stdout (the first epoch's: since the process started); throughput leaves out that first
(warm-up) epoch. Rounds run every variant once, in an order rotated from round to round; each ratio is taken
within a round and then averaged, so drift in the load of a shared machine falls on both sides of it. Prints
the tables and writes, under --out, bench.json (everything), table.md (the tables), loss.png (loss curves
overlaid) and throughput.png (samples/s with error bars).
"""

import argparse
import itertools
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "harness"))
import steps  # noqa: E402  (harness/steps.py: how each step is started)

QUICK = {"epochs": 3, "repeats": 2, "tiny_size": 8192, "vision_size": 768, "global_batch": 32}
FULL = {**QUICK, "epochs": 5, "repeats": 5, "tiny_size": 65536, "vision_size": 2048}


@dataclass
class Variant:
    """One way to run the training: which step of harness/steps.py, on how many processes in all."""

    name: str
    step: str
    ranks: int
    about: str
    script: Path | None = None  # another script than the step's example (the tutorial's loop)
    options: tuple = ()  # that script's own options
    one_process: bool = False  # one process drives all `ranks` GPUs (DataParallel)

    @property
    def processes(self):
        return 1 if self.one_process else self.ranks

    def command(self, args, workload):
        nproc = self.ranks // 2 if self.step == "multinode" else self.ranks  # per node
        vision = workload == "vision"  # the lesson run by examples/vision.py
        return steps.command(self.step, args, nproc=nproc, script=self.script, root=REPO, vision=vision)


def make_variants(nproc, gpus=0):
    tutorial = REPO / "benchmarks" / "tutorial_loop.py"
    variants = [
        Variant("plain", "single_gpu", 1, "single_gpu.py, one process, all cores"),
        Variant("tutorial", "single_gpu", 1, "the upstream tutorial's loop (tiny only)", tutorial),
        Variant(
            "tutorial_mse", "single_gpu", 1, "the same with MSE loss (tiny only)", tutorial, ("--loss", "mse")
        ),
        Variant("ddp_ws1", "multigpu_torchrun", 1, "DDP at world size 1 (torchrun)"),
    ]
    if nproc >= 2:
        variants += [
            Variant("spawn", "multigpu", nproc, "multigpu.py, mp.spawn"),
            Variant("torchrun", "multigpu_torchrun", nproc, "multigpu_torchrun.py"),
        ]
        if gpus >= 2 and nproc == gpus:  # DataParallel takes every visible GPU
            variants.append(
                Variant(
                    "dataparallel",
                    "multigpu_dataparallel",
                    gpus,
                    "nn.DataParallel, one process",
                    one_process=True,
                )
            )
        variants += [
            Variant("accelerate", "multigpu_accelerate", nproc, "multigpu_accelerate.py"),
        ]
        if nproc % 2 == 0:
            variants.append(
                Variant("two_nodes", "multinode", nproc, f"multinode.py, 2 local nodes x {nproc // 2}")
            )
    return variants


# Ratios: (numerator, denominator, what it measures, {workload: target}).
RATIOS = [
    ("plain", "tutorial", "single_gpu.py vs the tutorial's loop, same batch", {"tiny": 1.1}),
    ("plain", "tutorial_mse", "the same, like for like: the tutorial's loop with MSE", {}),
    ("ddp_ws1", "plain", "the DDP wrapper's own cost", {"vision": 0.97}),
    ("accelerate", "torchrun", "accelerate's convenience cost", {"vision": 0.97}),
    ("torchrun", "plain", "N ranks vs one process with all cores", {"vision": 0.9}),
    ("two_nodes", "torchrun", "two local nodes vs one node, same ranks", {}),
    ("spawn", "torchrun", "mp.spawn vs torchrun", {}),
    ("dataparallel", "torchrun", "nn.DataParallel (one process, threads) vs DDP, same GPUs", {}),
]


# The line rank 0 of a lesson (and benchmarks/tutorial_loop.py) prints per epoch,
#     epoch 3/10 | loss 0.000102278 | world_size 2
# after any bracketed prefixes: "[node0] " from a launcher, "(RayTrainWorker pid=123) " from Ray.
EPOCH_LINE = re.compile(
    r"^(?:\([^()]*\)\s*|\[[^\[\]]*\]\s*)*"
    r"epoch (?P<epoch>\d+)/\d+ \| "
    r"loss (?P<loss>[-+]?(?:\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|nan|inf)) \| "
    r"world_size (?P<world_size>\d+)\s*$"
)
ANSI_CODE = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours its prefixes


def rates(arrivals, start, dataset_size):
    """samples/s per epoch: dataset_size over the time since the previous epoch line arrived (the first
    epoch: since start)."""
    return [dataset_size / (now - before) for before, now in itertools.pairwise([start, *arrivals])]


def parse_epochs(lines, start, dataset_size):
    """The per-epoch metrics in one process's output, lines as (arrival, text): one dict per epoch line, in
    the order printed, its samples/s measured from the arrivals."""
    matches, arrivals = [], []
    for arrival, line in lines:
        match = EPOCH_LINE.match(ANSI_CODE.sub("", line))
        if match:
            matches.append(match)
            arrivals.append(arrival)
    speeds = rates(arrivals, start, dataset_size)
    return [
        {
            "epoch": int(m["epoch"]),
            "loss": float(m["loss"]),
            "samples_per_s": speed,
            "world_size": int(m["world_size"]),
        }
        for m, speed in zip(matches, speeds, strict=True)
    ]


def pump(stream, out, lock, lines):
    """Copy a process's output to out line by line, noting in lines each one's arrival (time.monotonic())."""
    with stream:
        for line in stream:
            lines.append((time.monotonic(), line))
            with lock:
                if not out.closed:
                    out.write(line)
                    out.flush()


def run_variant(variant, workload, settings, folder, timeout):
    """Train once; return the per-epoch metrics from rank 0's epoch lines, timed as they arrive. Every
    process ends within the timeout."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "snapshot.pt").unlink(missing_ok=True)
    epochs = settings["epochs"]
    size = settings[f"{workload}_size"]
    args = [epochs, epochs, "--dataset_size", size, "--seed", settings["seed"]]
    args += ["--batch_size", settings["global_batch"] // variant.processes]
    args += ["--snapshot_path", folder / "snapshot.pt", *variant.options]
    threads = max(
        1, settings["cores"] // variant.processes
    )  # every process, both "nodes" too, on this machine
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    log = folder / "output.log"
    procs = []
    readers = []  # per process: (its start, its lines as (arrival, text), the thread reading them)
    lock = threading.Lock()
    deadline = time.monotonic() + timeout
    with open(log, "w") as out:
        try:
            for cmd in variant.command(args, workload):
                start = time.monotonic()
                procs.append(
                    subprocess.Popen(
                        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                        env=env, cwd=folder,
                        start_new_session=True,  # a process group of its own, to end it with its children
                    )
                )  # fmt: skip
                lines = []
                reader = threading.Thread(target=pump, args=(procs[-1].stdout, out, lock, lines), daemon=True)
                reader.start()
                readers.append((start, lines, reader))
            codes = [p.wait(timeout=max(1, deadline - time.monotonic())) for p in procs]
        except subprocess.TimeoutExpired:
            codes = None
        finally:
            for p in procs:  # SIGTERM first: torchrun passes it on to its workers, a SIGKILL would not
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGTERM)
                    try:
                        p.wait(timeout=15)
                    except subprocess.TimeoutExpired:
                        os.killpg(p.pid, signal.SIGKILL)
                        p.wait(timeout=30)
            for _, _, reader in readers:  # a child that left the group could hold the pipe open: bounded
                reader.join(timeout=10)
            with lock:  # closed here, not by `with`, so that no reader left over writes to it
                out.close()
    output = log.read_text(errors="replace")
    found = []
    if codes is not None and not any(codes):
        for start, lines, _ in readers:
            found += parse_epochs(list(lines), start, size)
    if codes is None or any(codes) or len(found) != epochs:
        if codes is None:
            reason = f"timed out after {timeout}s"
        elif any(codes):
            reason = f"exit codes {codes}"
        else:
            reason = f"{len(found)} epochs' metrics found, {epochs} expected"
        raise RuntimeError(f"{variant.name} on {workload}: {reason}; log {log}:\n{output[-3000:]}")
    return found


def throughput(epochs):
    """Samples per second over every epoch but the first (epochs of equal size: the harmonic mean)."""
    return statistics.harmonic_mean([e["samples_per_s"] for e in epochs[1:] or epochs])


def spread(values):
    """mean, sample standard deviation, median, min, max and count."""
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {
        "mean": statistics.fmean(values),
        "median": statistics.median(values),
        "std": std,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def verdict(ratio, target):
    """met or NOT met only when the whole mean ± std band lies on one side of the target."""
    if ratio["mean"] - ratio["std"] >= target:
        return "met"
    if ratio["mean"] + ratio["std"] < target:
        return "NOT met"
    return f"{'above' if ratio['mean'] >= target else 'below'} on average, within the spread: repeat"


def describe_machine():
    import accelerate
    import torch

    cpu = platform.processor()
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    commit = subprocess.run(
        ["git", "-C", REPO, "describe", "--always", "--dirty"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "host": socket.gethostname(),
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "gpus": gpus,
        "backend": "nccl" if gpus else "gloo",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "accelerate": accelerate.__version__,
        "commit": commit,
    }


def summarize(results, variants, settings):
    """Per workload: throughput per variant, ratios taken round by round, and how far the losses agree."""
    summary = {}
    ranks = {v.name: v.ranks for v in variants}
    own_data = {v.name for v in variants if v.script}  # the tutorial's loops, on data of their own
    for workload in settings["workloads"]:
        runs = {
            v.name: [r for r in results if r["workload"] == workload and r["variant"] == v.name]
            for v in variants
        }
        table = {}
        for v in variants:
            if runs[v.name]:
                stats = spread([r["samples_per_s"] for r in runs[v.name]])
                table[v.name] = {**stats, "ranks": v.ranks, "about": v.about}
                table[v.name]["step_ms"] = 1000 * settings["global_batch"] / stats["mean"]
                table[v.name]["final_loss"] = runs[v.name][0]["losses"][-1]
        ratios = {}
        for top, bottom, about, targets in RATIOS:
            # On GPUs a rank brings its own device: compare per rank. On CPUs every variant shares the cores.
            per = ranks[top] / ranks[bottom] if settings["gpus"] and top in table and bottom in table else 1
            pairs = [
                a["samples_per_s"] / b["samples_per_s"] / per
                for a in runs.get(top, [])
                for b in runs.get(bottom, [])
                if a["round"] == b["round"]
            ]
            if pairs:
                ratio = {**spread(pairs), "about": f"{about}, per rank" if per != 1 else about, "verdict": ""}
                if workload in targets:
                    ratio["target"] = target = targets[workload]
                    ratio["verdict"] = f"target >= {target}: {verdict(ratio, target)}"
                ratios[f"{top}/{bottom}"] = ratio
        agreement = {}  # against plain, in the same round
        for name, mine in runs.items():
            diffs = [
                max(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True))
                for a in mine
                for b in runs.get("plain", [])
                if a["round"] == b["round"] and name != "plain" and name not in own_data
            ]
            if diffs:
                agreement[name] = max(diffs)
        summary[workload] = {"variants": table, "ratios": ratios, "max_abs_loss_diff_vs_plain": agreement}
    return summary


def markdown(summary, settings, machine):
    """The report: printed, and written to table.md for README.md."""

    def row(*cells):
        return "| " + " | ".join(map(str, cells)) + " |"

    lines = [
        f"Measured {machine['date_utc']} UTC on {machine['cpu']} ({machine['cores']} cores, GPUs: "
        f"{', '.join(machine['gpus']) or 'none'}, {machine['backend']}), python {machine['python']}, "
        f"torch {machine['torch']}, accelerate {machine['accelerate']}, commit {machine['commit']}; "
        f"{settings['mode']} mode, rounds: {settings['repeats']} of {settings['epochs']} epochs each (the "
        f"first not counted), global batch {settings['global_batch']}; load average "
        f"{settings['load_before']} before, {settings['load_after']} after.",
    ]
    for workload, part in summary.items():
        lines += ["", f"**{workload}** ({settings[f'{workload}_size']} samples per epoch)", ""]
        lines += [
            row("variant", "ranks", "samples/s (mean ± std)", "min-max", "ms/step", "final loss", "what")
        ]
        lines += ["|---|---:|---:|---:|---:|---:|---|"]
        for name, r in part["variants"].items():
            speed, low_high = f"{r['mean']:.1f} ± {r['std']:.1f}", f"{r['min']:.0f}-{r['max']:.0f}"
            lines.append(
                row(
                    name,
                    r["ranks"],
                    speed,
                    low_high,
                    f"{r['step_ms']:.2f}",
                    f"{r['final_loss']:.6g}",
                    r["about"],
                )
            )
        lines += ["", row("ratio, within a round", "mean ± std", "median", "measures", "target")]
        lines += ["|---|---:|---:|---|---|"]
        for name, r in part["ratios"].items():
            mean = f"{r['mean']:.3f} ± {r['std']:.3f}"
            lines.append(row(name, mean, f"{r['median']:.3f}", r["about"], r["verdict"]))
        agree = ", ".join(f"{k} {v:.1e}" for k, v in part["max_abs_loss_diff_vs_plain"].items())
        lines += ["", f"Largest |loss - plain's loss| over the epochs: {agree or 'n/a'}."]
    return "\n".join(lines) + "\n"


def plot(results, summary, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    styles = ["-o", "--s", ":^", "-.v", "-D", "--x", ":+", "-.*"]
    for kind in ("loss", "throughput"):
        fig, axes = plt.subplots(1, len(summary), figsize=(6 * len(summary), 4), squeeze=False)
        for ax, (workload, part) in zip(axes[0], summary.items(), strict=True):
            names = list(part["variants"])
            mine = [[r for r in results if r["workload"] == workload and r["variant"] == n] for n in names]
            if kind == "loss":
                for i, (name, runs) in enumerate(zip(names, mine, strict=True)):
                    losses = runs[0]["losses"]
                    if min(losses) <= 0:  # off a log scale: the tutorial's cross-entropy is identically 0
                        continue
                    style = styles[i % len(styles)]
                    ax.plot(range(1, len(losses) + 1), losses, style, label=name, alpha=0.8, markersize=9 - i)
                ax.set(
                    title=f"{workload}: loss per epoch (round 1)", xlabel="epoch", ylabel="mean training loss"
                )
                ax.set_yscale("log")
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
                ax.legend(fontsize=8)
            else:
                rows = part["variants"]
                ax.bar(
                    names, [rows[n]["mean"] for n in names], yerr=[rows[n]["std"] for n in names], capsize=4
                )
                for i, runs in enumerate(mine):
                    ax.plot([i] * len(runs), [r["samples_per_s"] for r in runs], "k.", markersize=5)
                ax.set(title=f"{workload}: samples/s (mean ± std, dots: rounds)", ylabel="samples/s")
                ax.tick_params(axis="x", labelrotation=30)
        fig.tight_layout()
        fig.savefig(out / f"{kind}.png", dpi=80)
        plt.close(fig)


def get_parser():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="longer runs: " + json.dumps(FULL))
    parser.add_argument("--workloads", nargs="+", choices=["tiny", "vision"], default=["tiny", "vision"])
    parser.add_argument("--variants", nargs="+", help="a subset of the variants (default: all)")
    parser.add_argument("--repeats", type=int, help=f"rounds (quick {QUICK['repeats']})")
    parser.add_argument(
        "--epochs", type=int, help=f"epochs per run, the first not counted (quick {QUICK['epochs']})"
    )
    parser.add_argument("--tiny_size", type=int, help=f"tiny: samples per epoch (quick {QUICK['tiny_size']})")
    parser.add_argument(
        "--vision_size", type=int, help=f"vision: samples per epoch (quick {QUICK['vision_size']})"
    )
    parser.add_argument("--global_batch", type=int, help="samples per step over all ranks (default 32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nproc", type=int, help="ranks of the multi-rank variants (default: GPUs, or 2)")
    parser.add_argument("--run_timeout", type=float, default=600, help="seconds one training run may take")
    parser.add_argument("--out", type=Path, default=REPO / "bench-results", help="where results go")
    return parser


def main(argv=None):
    parser = get_parser()
    args = parser.parse_args(argv)
    # SIGTERM (timeout, kill) acts as Ctrl-C: the running training's processes are ended, and the runs
    # completed so far are reported
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    settings = {**(FULL if args.full else QUICK)}
    for key in ("epochs", "repeats", "tiny_size", "vision_size", "global_batch"):
        value = settings[key] = settings[key] if getattr(args, key) is None else getattr(args, key)
        if value < (2 if key == "epochs" else 1):
            least = "2 or more (the first epoch is not measured)" if key == "epochs" else "positive"
            parser.error(f"--{key} must be {least}, got {value}")
    machine = describe_machine()
    variants = make_variants(args.nproc or len(machine["gpus"]) or 2, len(machine["gpus"]))
    if args.variants:
        unknown = set(args.variants) - {v.name for v in variants}
        if unknown:
            parser.error(f"unknown variants {sorted(unknown)}; known: {[v.name for v in variants]}")
        variants = [v for v in variants if v.name in args.variants]
    for v in variants:
        if settings["global_batch"] % v.ranks:
            parser.error(
                f"--global_batch {settings['global_batch']} does not split evenly over {v.ranks} ranks"
            )
    settings.update(
        workloads=args.workloads,
        seed=args.seed,
        cores=machine["cores"],
        gpus=len(machine["gpus"]),
        mode="full" if args.full else "quick",
        load_before=[round(x, 2) for x in os.getloadavg()],
    )
    plan = [(w, v) for w in args.workloads for v in variants if not v.script or w == "tiny"]
    if not plan:
        parser.error("nothing to run: the tutorial variants run the tiny workload only")
    out = args.out.resolve()  # the runs work in folders of their own
    out.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        for round_ in range(1, settings["repeats"] + 1):
            shift = (round_ - 1) % len(plan)
            for workload, v in plan[shift:] + plan[:shift]:  # rotated from round to round
                start = time.perf_counter()
                folder = out / "runs" / workload / v.name / f"round{round_}"
                epochs = run_variant(v, workload, settings, folder, args.run_timeout)
                rate, wall = throughput(epochs), time.perf_counter() - start
                losses = [e["loss"] for e in epochs]
                results.append(
                    {"workload": workload, "variant": v.name, "round": round_, "samples_per_s": rate,
                     "losses": losses, "epochs": epochs, "wall_s": wall}
                )  # fmt: skip
                print(
                    f"[{len(results)}/{settings['repeats'] * len(plan)}] round {round_} {workload:<6} "
                    f"{v.name:<10} {rate:9.1f} samples/s  ({wall:.0f} s with start-up)",
                    flush=True,
                )
    except KeyboardInterrupt:
        if not results:
            raise
        settings["interrupted_after_runs"] = len(results)
        print(f"interrupted: reporting the {len(results)} runs completed", flush=True)
    settings["load_after"] = [round(x, 2) for x in os.getloadavg()]
    settings["workloads"] = [w for w in args.workloads if any(r["workload"] == w for r in results)]
    summary = summarize(results, variants, settings)
    table = markdown(summary, settings, machine)
    print("\n" + table)
    report = {"machine": machine, "settings": settings, "summary": summary, "runs": results}
    (out / "bench.json").write_text(json.dumps(report, indent=1))
    (out / "table.md").write_text(table)
    plot(results, summary, out)
    print(
        "wrote "
        + ", ".join(str(out / name) for name in ("bench.json", "table.md", "loss.png", "throughput.png"))
    )
    return report


if __name__ == "__main__":
    main()
