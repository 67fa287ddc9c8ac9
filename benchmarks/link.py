"""Two-node throughput in containers on an unshaped link and on slower ones (compose profile "shaped").

    python benchmarks/link.py                          # unshaped, 1gbit, 100mbit; vision, 256 samples, 1+1
    python benchmarks/link.py --rates 1gbit 10mbit --workload tiny --nproc 2 --repeats 2

Runs the root compose.yaml once per link rate and repeat, in a rotated order, under a project name of its
own (removed afterwards), with the image Compose would use (built first if missing); the nodes' command
gets --dataset_size added, and for vision examples/vision.py in front (ResNet-18). An epoch's samples/s is
--dataset_size over the time between Docker's timestamps of node0's consecutive epoch lines (rank 0's);
throughput is their mean over the epochs after the first (warm-up). Prints samples/s per rate and its
ratio to the unshaped link, each ratio taken within the same round.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# a line of `docker compose logs --timestamps --no-log-prefix node0`: Docker's RFC 3339 time, then rank 0's
#     2026-11-28T01:02:03.123456789Z epoch 2/3 | loss 0.5 | world_size 2
EPOCH_RE = re.compile(r"^(\S+) epoch (\d+)/\d+ \| loss \S+ \| world_size \d+", re.M)
UNSHAPED = "unshaped"
LOGS = ["logs", "--timestamps", "--no-log-prefix", "node0"]


def compose(project, rate, env, *args, timeout, extra=None):
    cmd = ["docker", "compose", "-p", project, "-f", str(REPO / "compose.yaml")]
    cmd += ["-f", extra] if extra else []
    if rate != UNSHAPED:
        cmd += ["--profile", "shaped"]
    run_env = {**os.environ, **env, **({"LINK_RATE": rate} if rate != UNSHAPED else {})}
    return subprocess.run(
        [*cmd, *args], env=run_env, capture_output=True, text=True, timeout=timeout, check=False
    )


def node_commands(env, size, folder, vision):
    """A compose file for -f that adds --dataset_size to both nodes' command as compose.yaml resolves it,
    and with vision runs it by examples/vision.py (ResNet-18)."""
    config = compose("ddplinkbench", "unshaped", env, "config", "--format", "json", timeout=60)
    if config.returncode != 0:
        sys.exit(f"error: docker compose config failed:\n{config.stderr}")
    services = json.loads(config.stdout)["services"]
    wrapper = ["examples/vision.py"] if vision else []
    extra = {
        n: {"command": [*wrapper, *services[n]["command"], f"--dataset_size={size}"]}
        for n in ("node0", "node1")
    }
    path = Path(folder) / "dataset-size.yaml"
    path.write_text(json.dumps({"services": extra}))  # JSON is YAML
    return str(path)


def epoch_rates(logs, dataset_size):
    """samples/s of each epoch after the first: dataset_size over the time since the previous epoch line."""
    times = {int(epoch): datetime.fromisoformat(stamp).timestamp() for stamp, epoch in EPOCH_RE.findall(logs)}
    return [dataset_size / (times[e] - times[e - 1]) for e in sorted(times) if e > 1 and e - 1 in times]


def throughput(project, rate, env, timeout, extra, dataset_size):
    """samples/s of one run at this rate: rank 0's epochs after the first, averaged."""
    compose(project, rate, env, "down", "--volumes", "--remove-orphans", timeout=120, extra=extra)
    try:
        up = ["up", "--abort-on-container-exit", "--exit-code-from", "node0"]
        proc = compose(project, rate, env, *up, timeout=timeout, extra=extra)
        logs = compose(project, rate, env, *LOGS, timeout=60, extra=extra).stdout
    finally:
        compose(project, rate, env, "down", "--volumes", "--remove-orphans", timeout=120, extra=extra)
    if proc.returncode != 0:
        sys.exit(f"error: the run at {rate} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    rates = epoch_rates(logs, dataset_size)
    if not rates:
        sys.exit(f"error: no epoch after the first in node0's output at {rate}:\n{logs[-3000:]}")
    return statistics.mean(rates)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", nargs="+", default=["1gbit", "100mbit"], help="tc rates besides unshaped")
    parser.add_argument("--workload", choices=["tiny", "vision"], default="vision", help="default: vision")
    parser.add_argument("--dataset_size", type=int, default=256, help="samples per epoch (default 256)")
    parser.add_argument("--nproc", type=int, default=1, help="processes per node (default 1)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per run, 1st left out (default 3)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over all rates (default 1)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds one run may take (default 900)")
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error("--epochs must be at least 2: the first epoch is left out")
    env = {"NPROC_PER_NODE": str(args.nproc), "EPOCHS": str(args.epochs)}
    env["SAVE_EVERY"] = str(args.epochs)
    rates = [UNSHAPED, *args.rates]
    results = {rate: [] for rate in rates}
    with tempfile.TemporaryDirectory() as folder:
        extra = node_commands(env, args.dataset_size, folder, args.workload == "vision")
        for round_ in range(args.repeats):
            order = rates[round_ % len(rates) :] + rates[: round_ % len(rates)]
            for rate in order:
                project = f"ddplinkbench{os.getpid()}"
                results[rate].append(throughput(project, rate, env, args.timeout, extra, args.dataset_size))
                print(f"round {round_ + 1}: {rate}: {results[rate][-1]:.0f} samples/s", flush=True)
    n = args.nproc
    print(
        f"\n{args.workload}, {args.dataset_size} samples, {n}+{n} processes, {args.epochs} epochs,", end=" "
    )
    print(f"{args.repeats} rounds")
    print(f"{'link':>10} {'samples/s':>10} {'vs unshaped':>12}")
    for rate in rates:
        ratio = statistics.mean(s / u for s, u in zip(results[rate], results[UNSHAPED], strict=True))
        print(f"{rate:>10} {statistics.mean(results[rate]):>10.0f} {ratio:>12.2f}")


if __name__ == "__main__":
    main()
