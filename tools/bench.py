"""Measure the examples side by side: every launcher on the same workloads, interleaved and repeated.

    python tools/bench.py                      # quick: a few minutes on 2 cores (what `make bench` runs)
    python tools/bench.py --full               # longer epochs, more samples, more repeats
    python tools/bench.py --workloads vision --repeats 5 --variants plain torchrun tuned plain_accum

Every variant trains the same model from the same seed with the same global batch, so their loss curves
should coincide. Throughput leaves out the first (warm-up) epoch. Rounds run every variant once, in an order
rotated from round to round; each ratio is taken within a round and then averaged, so drift in the load of a
shared machine falls on both sides of it. Prints one table per workload and writes, under --out,
bench.json (everything), loss.png (loss curves overlaid) and throughput.png (samples/s with error bars).
"""

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
QUICK = {"epochs": 3, "repeats": 2, "tiny_size": 8192, "vision_size": 768}
FULL = {"epochs": 5, "repeats": 5, "tiny_size": 65536, "vision_size": 2048}
# Dense bf16 tensor-core peaks from the vendors' datasheets, per GPU, for model FLOPs utilisation (MFU).
PEAK_BF16_TFLOPS = {
    "H200": 989,
    "H100 PCIe": 756,
    "H100": 989,
    "A100": 312,
    "L40S": 362,
    "L4": 121,
    "A10": 125,
}
# What the tuned variants add; README.md (Performance) explains each option.
TUNED = "--grad_accum 4 --comm_hook fp16 --gradient_as_bucket_view"


@dataclass
class Variant:
    """One way to run the training: which example, how it is launched, on how many processes."""

    name: str
    script: str
    launcher: str  # python | spawn | torchrun | nodes
    ranks: int
    extra: list = field(default_factory=list)
    recipe: str = "default"  # variants with the same recipe take the same optimizer steps
    about: str = ""

    def command(self, args, port):
        script = EXAMPLES / f"{self.script}.py"
        python = [sys.executable, "-u"]
        torchrun = [sys.executable, "-m", "torch.distributed.run"]
        if self.launcher == "python":
            return [[*python, script, *args]]
        if self.launcher == "spawn":
            return [[*python, script, *args, "--nproc", str(self.ranks)]]
        if self.launcher == "torchrun":
            return [[*torchrun, "--standalone", f"--nproc-per-node={self.ranks}", script, *args]]
        per_node = self.ranks // 2
        rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}", f"--rdzv-id=bench{port}"]
        node = [*torchrun, "--nnodes=2", f"--nproc-per-node={per_node}", *rendezvous, script, *args]
        return [node, node]


def make_variants(nproc, tuned):
    tuned = tuned.split()
    at = tuned.index("--grad_accum") if "--grad_accum" in tuned else len(tuned)
    accum = tuned[at : at + 2]  # the single process takes the same optimizer steps
    variants = [
        Variant("plain", "single_gpu", "python", 1, about="single_gpu.py, one process, all cores"),
        Variant("ddp_ws1", "multigpu_torchrun", "torchrun", 1, about="DDP at world size 1 (torchrun)"),
    ]
    if nproc >= 2:
        variants += [
            Variant("spawn", "multigpu", "spawn", nproc, about="multigpu.py, mp.spawn"),
            Variant("torchrun", "multigpu_torchrun", "torchrun", nproc, about="multigpu_torchrun.py"),
            Variant("accelerate", "multigpu_accelerate", "torchrun", nproc, about="multigpu_accelerate.py"),
        ]
        if nproc % 2 == 0:
            about = f"multinode.py, 2 local nodes x {nproc // 2}"
            variants.append(Variant("two_nodes", "multinode", "nodes", nproc, about=about))
        if tuned:
            about = "single_gpu.py with the tuned variant's accumulation"
            variants.append(Variant("plain_accum", "single_gpu", "python", 1, accum, "accum", about))
            about = f"multigpu_torchrun.py {' '.join(tuned)}"
            variants.append(Variant("tuned", "multigpu_torchrun", "torchrun", nproc, tuned, "accum", about))
    return variants


# Ratios: (name, numerator, denominator, what it measures, target for the vision workload or None).
RATIOS = [
    ("ddp_ws1/plain", "ddp_ws1", "plain", "the DDP wrapper's own cost", 0.97),
    ("accelerate/torchrun", "accelerate", "torchrun", "accelerate's convenience cost", 0.97),
    ("torchrun/plain", "torchrun", "plain", "N ranks vs one process with all cores", 0.9),
    ("tuned/plain_accum", "tuned", "plain_accum", "N ranks tuned vs one process, same steps", 0.9),
    ("two_nodes/torchrun", "two_nodes", "torchrun", "two local nodes vs one node, same ranks", None),
    ("spawn/torchrun", "spawn", "torchrun", "mp.spawn vs torchrun", None),
]


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def run_variant(variant, workload, settings, folder, timeout):
    """Train once; return the per-epoch metrics rank 0 wrote. Every process ends within the timeout."""
    folder.mkdir(parents=True, exist_ok=True)
    metrics = folder / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    (folder / "snapshot.pt").unlink(missing_ok=True)
    batch = settings["global_batch"] // variant.ranks
    size = settings[f"{workload}_size"]
    epochs = settings["epochs"]
    args = [epochs, epochs, "--workload", workload, "--dataset_size", size, "--batch_size", batch]
    args += ["--image_size", settings["image_size"], "--seed", settings["seed"], *variant.extra]
    args += ["--snapshot_path", folder / "snapshot.pt", "--metrics_path", metrics]
    threads = max(1, settings["cores"] // variant.ranks)  # every rank, both "nodes" too, on this machine
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    log = folder / "output.log"
    procs = []
    deadline = time.monotonic() + timeout
    with open(log, "w") as out:
        try:
            for cmd in variant.command([str(a) for a in args], free_port()):
                procs.append(
                    subprocess.Popen(
                        [str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=folder,
                        start_new_session=True,  # a process group of its own, to end it with its children
                    )
                )  # fmt: skip
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
    if codes is None or any(codes) or not metrics.exists():
        tail = log.read_text()[-3000:]
        reason = f"timed out after {timeout}s" if codes is None else f"exit codes {codes}"
        raise RuntimeError(f"{variant.name} on {workload}: {reason}; log {log}:\n{tail}")
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def throughput(epochs):
    """Samples per second over every epoch but the first."""
    measured = epochs[1:] or epochs
    samples = sum(e["samples_per_s"] * e["epoch_time_s"] for e in measured)
    return samples / sum(e["epoch_time_s"] for e in measured)


def spread(values):
    """mean, sample standard deviation, min, max and count."""
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {
        "mean": statistics.fmean(values),
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


def train_flops_per_sample(workload, image_size):
    """FLOPs of one forward and backward pass per sample, counted on the model itself."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    if workload == "tiny":
        model, batch = torch.nn.Linear(20, 1), torch.randn(8, 20)
    else:
        from torchvision.models import resnet18

        model, batch = resnet18(num_classes=10), torch.randn(8, 3, image_size, image_size)
    with FlopCounterMode(display=False) as counter:
        model(batch).sum().backward()
    return counter.get_total_flops() / len(batch)


def gpu_peak_flops(name, override_tflops):
    if override_tflops:
        return override_tflops * 1e12
    for key, tflops in PEAK_BF16_TFLOPS.items():  # the longer names come first where they overlap
        if key in name:
            return tflops * 1e12
    return None


def describe_machine():
    import accelerate
    import torch
    import torchvision

    cpu = platform.processor()
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
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
        "torchvision": torchvision.__version__,
        "accelerate": accelerate.__version__,
        "commit": commit,
    }


def summarize(results, variants, settings):
    """Per workload: throughput per variant, ratios taken round by round, and how far the losses agree."""
    summary = {}
    for workload in settings["workloads"]:
        runs = [r for r in results if r["workload"] == workload]
        by_variant = {v.name: [r for r in runs if r["variant"] == v.name] for v in variants}
        table = {}
        for v in variants:
            rates = [r["samples_per_s"] for r in by_variant[v.name]]
            if not rates:
                continue
            stats = spread(rates)
            table[v.name] = {
                **stats,
                "ranks": v.ranks,
                "about": v.about,
                "step_ms": 1000 * settings["global_batch"] / stats["mean"],
                "train_gflops_per_s": settings["flops"][workload] * stats["mean"] / 1e9,
                "final_loss": by_variant[v.name][0]["losses"][-1],
            }
            peak = settings["peak_flops"]
            if peak:
                table[v.name]["mfu"] = settings["flops"][workload] * stats["mean"] / (peak * max(1, v.ranks))
        ratios = {}
        ranks = {v.name: v.ranks for v in variants}
        for name, top, bottom, about, target in RATIOS:
            # On GPUs a rank brings its own device: compare per rank. On CPUs every variant shares the cores.
            per = ranks[top] / ranks[bottom] if settings["gpus"] and top in ranks and bottom in ranks else 1
            pairs = [
                a["samples_per_s"] / b["samples_per_s"] / per
                for a in by_variant.get(top, [])
                for b in by_variant.get(bottom, [])
                if a["round"] == b["round"]
            ]
            if pairs:
                target = target if workload == "vision" else None
                about = f"{about}, per rank" if per != 1 else about
                ratios[name] = {**spread(pairs), "about": about, "target": target}
                ratios[name]["verdict"] = ""
                if target is not None:
                    ratios[name]["met"] = ratios[name]["mean"] >= target
                    ratios[name]["verdict"] = f"target >= {target}: {verdict(ratios[name], target)}"
        agreement = {}
        for v in variants:
            reference = "plain" if v.recipe == "default" else "plain_accum"
            diffs = [
                max(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True))
                for a in by_variant.get(v.name, [])
                for b in by_variant.get(reference, [])
                if a["round"] == b["round"]
            ]
            if diffs:
                agreement[v.name] = {"reference": reference, "max_abs_loss_diff": max(diffs)}
        acc, ddp = by_variant.get("accelerate", []), by_variant.get("torchrun", [])
        if acc and ddp and "accelerate/torchrun" in ratios:
            ratios["accelerate/torchrun"]["max_abs_loss_diff"] = max(
                max(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True))
                for a in acc
                for b in ddp
                if a["round"] == b["round"]
            )
        summary[workload] = {"variants": table, "ratios": ratios, "loss_agreement": agreement}
    return summary


def print_report(summary, settings, machine):
    gpus = ", ".join(machine["gpus"]) or "none"
    print(f"\n{machine['date_utc']} UTC  {machine['host']}  commit {machine['commit']}")
    print(f"CPU {machine['cpu']} ({machine['cores']} cores)  GPUs: {gpus}  backend {machine['backend']}")
    print(
        f"python {machine['python']}  torch {machine['torch']}  torchvision {machine['torchvision']}  "
        f"accelerate {machine['accelerate']}  "
        f"load average {settings['load_before']} -> {settings['load_after']}"
    )
    for workload, part in summary.items():
        size = settings[f"{workload}_size"]
        print(
            f"\n{workload}: global batch {settings['global_batch']}, {size} samples/epoch, "
            f"{settings['epochs']} epochs (first excluded), {settings['repeats']} rounds, "
            f"{settings['flops'][workload] / 1e6:.3g} MFLOP per sample (forward + backward)"
        )
        print(
            f"  {'variant':<12} {'ranks':>5} {'samples/s (mean ± std)':>24} {'min-max':>13} {'ms/step':>8} "
            f"{'GFLOP/s':>8} {'MFU':>6} {'final loss':>11}  what"
        )
        for name, row in part["variants"].items():
            mfu = f"{row['mfu']:.1%}" if "mfu" in row else "n/a"
            print(
                f"  {name:<12} {row['ranks']:>5} {row['mean']:>15.1f} ± {row['std']:<6.1f} "
                f"{row['min']:>6.0f}-{row['max']:<6.0f} {row['step_ms']:>8.1f} "
                f"{row['train_gflops_per_s']:>8.3g} "
                f"{mfu:>6} {row['final_loss']:>11.6g}  {row['about']}"
            )
        print("  ratios, each within a round (mean ± std over rounds):")
        for name, ratio in part["ratios"].items():
            loss = f", max loss diff {ratio['max_abs_loss_diff']:.1e}" if "max_abs_loss_diff" in ratio else ""
            print(
                f"    {name:<20} {ratio['mean']:.3f} ± {ratio['std']:.3f}  {ratio['about']}{loss}  "
                f"{ratio['verdict']}"
            )
        agree = ", ".join(f"{k} {v['max_abs_loss_diff']:.1e}" for k, v in part["loss_agreement"].items())
        print(f"  max |loss - reference| per variant (plain, or plain_accum for accumulation): {agree}")
    print(
        "\nms/step: time per global batch of "
        f"{settings['global_batch']} samples (with --grad_accum K an optimizer step is K of them)."
    )
    if not settings["peak_flops"]:
        print("MFU: n/a without a GPU (it is model FLOP/s over the GPU's dense bf16 peak).")


def markdown(summary, settings, machine):
    """The tables again, in Markdown, for README.md."""
    lines = [
        f"Measured {machine['date_utc']} UTC on {machine['cpu']} ({machine['cores']} cores, GPUs: "
        f"{', '.join(machine['gpus']) or 'none'}), torch {machine['torch']}, "
        f"accelerate {machine['accelerate']}, "
        f"commit {machine['commit']}; {settings['mode']} mode, {settings['repeats']} rounds of "
        f"{settings['epochs']} epochs, global batch {settings['global_batch']}; load average "
        f"{settings['load_before'][0]} before, {settings['load_after'][0]} after.",
    ]
    for workload, part in summary.items():
        lines += [
            "",
            f"**{workload}** ({settings[f'{workload}_size']} samples per epoch)",
            "",
            "| variant | ranks | samples/s (mean ± std) | ms/step | final loss | what |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for name, row in part["variants"].items():
            lines.append(
                f"| {name} | {row['ranks']} | {row['mean']:.1f} ± {row['std']:.1f} | {row['step_ms']:.1f} "
                f"| {row['final_loss']:.6g} | {row['about']} |"
            )
        lines += ["", "| ratio | mean ± std | measures | target |", "|---|---:|---|---|"]
        for name, ratio in part["ratios"].items():
            loss = f"; max loss diff {ratio['max_abs_loss_diff']:.1e}" if "max_abs_loss_diff" in ratio else ""
            lines.append(
                f"| {name} | {ratio['mean']:.3f} ± {ratio['std']:.3f} | {ratio['about']}{loss} "
                f"| {ratio['verdict']} |"
            )
    return "\n".join(lines) + "\n"


def plot(results, summary, settings, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    workloads = settings["workloads"]
    styles = ["-o", "--s", ":^", "-.v", "-D", "--x", ":+", "-.*"]
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        names = list(summary[workload]["variants"])
        for i, name in enumerate(names):
            run = next(r for r in results if r["workload"] == workload and r["variant"] == name)
            epochs = range(1, len(run["losses"]) + 1)
            ax.plot(epochs, run["losses"], styles[i % len(styles)], label=name, alpha=0.8, markersize=9 - i)
        ax.set(title=f"{workload}: loss per epoch (round 1)", xlabel="epoch", ylabel="mean training loss")
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=80)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        rows = summary[workload]["variants"]
        names = list(rows)
        ax.bar(names, [rows[n]["mean"] for n in names], yerr=[rows[n]["std"] for n in names], capsize=4)
        for i, name in enumerate(names):
            rates = [
                r["samples_per_s"] for r in results if r["workload"] == workload and r["variant"] == name
            ]
            ax.plot([i] * len(rates), rates, "k.", markersize=5)
        ax.set(title=f"{workload}: samples/s (mean ± std, dots: rounds)", ylabel="samples/s")
        ax.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=80)
    plt.close(fig)


def get_parser():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="longer runs: " + json.dumps(FULL))
    parser.add_argument("--workloads", nargs="+", choices=["tiny", "vision"], default=["tiny", "vision"])
    parser.add_argument("--variants", nargs="+", help="a subset of the variants (default: all)")
    parser.add_argument("--repeats", type=int, help=f"rounds (quick {QUICK['repeats']})")
    parser.add_argument(
        "--epochs", type=int, help=f"epochs per run, the first excluded (quick {QUICK['epochs']})"
    )
    parser.add_argument("--tiny_size", type=int, help=f"tiny: samples per epoch (quick {QUICK['tiny_size']})")
    parser.add_argument(
        "--vision_size", type=int, help=f"vision: samples per epoch (quick {QUICK['vision_size']})"
    )
    parser.add_argument("--global_batch", type=int, default=64, help="samples per step over all ranks")
    parser.add_argument("--image_size", type=int, default=32, help="vision: image side (default 32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nproc", type=int, help="ranks of the multi-rank variants (default: GPUs, or 2)")
    parser.add_argument("--tuned", default=TUNED, help=f"options of the tuned variant (default '{TUNED}')")
    parser.add_argument("--peak_tflops", type=float, help="GPU peak for MFU, if not in the built-in table")
    parser.add_argument("--run_timeout", type=float, default=600, help="seconds one training run may take")
    parser.add_argument("--out", type=Path, default=REPO / "bench-results", help="where results go")
    return parser


def main(argv=None):
    parser = get_parser()
    args = parser.parse_args(argv)
    # SIGTERM (timeout, kill) acts as Ctrl-C: the running training's processes are ended, and the runs
    # completed so far are reported
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    import torch

    settings = {**(FULL if args.full else QUICK)}
    for key in ("epochs", "repeats", "tiny_size", "vision_size"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    if settings["epochs"] < 2:
        parser.error("--epochs must be 2 or more: the first epoch is warm-up and not measured")
    gpus = torch.cuda.device_count()
    nproc = args.nproc or gpus or 2
    variants = make_variants(nproc, args.tuned)
    if args.variants:
        unknown = set(args.variants) - {v.name for v in variants}
        if unknown:
            parser.error(f"unknown variants {sorted(unknown)}; known: {[v.name for v in variants]}")
        variants = [v for v in variants if v.name in args.variants]
    machine = describe_machine()
    settings.update(
        workloads=args.workloads,
        global_batch=args.global_batch,
        image_size=args.image_size,
        seed=args.seed,
        nproc=nproc,
        tuned=args.tuned,
        cores=machine["cores"],
        gpus=len(machine["gpus"]),
        mode="full" if args.full else "quick",
        flops={w: train_flops_per_sample(w, args.image_size) for w in args.workloads},
        peak_flops=gpu_peak_flops(machine["gpus"][0], args.peak_tflops) if machine["gpus"] else None,
        load_before=[round(x, 2) for x in os.getloadavg()],
    )
    for v in variants:
        if args.global_batch % v.ranks:
            parser.error(f"--global_batch {args.global_batch} does not split evenly over {v.ranks} ranks")
    args.out = args.out.resolve()  # the runs work in folders of their own
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    total = settings["repeats"] * len(args.workloads) * len(variants)
    try:
        for round_ in range(settings["repeats"]):
            order = variants[round_ % len(variants) :] + variants[: round_ % len(variants)]  # rotate
            for workload in args.workloads:
                for v in order:
                    folder = args.out / "runs" / workload / v.name / f"round{round_ + 1}"
                    start = time.perf_counter()
                    epochs = run_variant(v, workload, settings, folder, args.run_timeout)
                    rate = throughput(epochs)
                    results.append(
                        {
                            "workload": workload,
                            "variant": v.name,
                            "round": round_ + 1,
                            "samples_per_s": rate,
                            "losses": [e["loss"] for e in epochs],
                            "epochs": epochs,
                            "wall_s": time.perf_counter() - start,
                        }
                    )
                    print(
                        f"[{len(results)}/{total}] round {round_ + 1} {workload:<6} {v.name:<12} "
                        f"{rate:9.1f} samples/s  ({results[-1]['wall_s']:.0f} s with start-up)",
                        flush=True,
                    )
    except KeyboardInterrupt:
        if not results:
            raise
        settings["interrupted_after_runs"] = len(results)
        print(f"interrupted: reporting the {len(results)} runs completed", flush=True)
    settings["load_after"] = [round(x, 2) for x in os.getloadavg()]
    summary = summarize(results, variants, settings)
    print_report(summary, settings, machine)
    report = {"machine": machine, "settings": settings, "summary": summary, "runs": results}
    (args.out / "bench.json").write_text(json.dumps(report, indent=1))
    (args.out / "table.md").write_text(markdown(summary, settings, machine))
    plot(results, summary, settings, args.out)
    written = ", ".join(
        str(args.out / name) for name in ("bench.json", "table.md", "loss.png", "throughput.png")
    )
    print(f"\nwrote {written}")
    return report


if __name__ == "__main__":
    main()
