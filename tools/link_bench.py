"""Two-node throughput in containers on an unshaped link and on slower ones (compose profile "shaped").

    python tools/link_bench.py                                   # unshaped, 1gbit, 100mbit; vision, 1+1
    python tools/link_bench.py --rates 1gbit 10mbit --workload tiny --nproc 2 --repeats 2

Runs the root compose.yaml once per link rate and repeat, in a rotated order, under a project name of its
own (removed afterwards), with the image Compose would use (built first if missing). Throughput is the
mean of rank 0's samples/s after the first (warm-up) epoch. Prints samples/s per rate and its ratio to the
unshaped link, each ratio taken within a round of the same repeat.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAMPLES_RE = re.compile(r"^epoch (\d+)/\d+ \| loss \S+ \| (\d+) samples/s", re.M)
UNSHAPED = "unshaped"


def compose(project, rate, env, *args, timeout):
    cmd = ["docker", "compose", "-p", project, "-f", str(REPO / "compose.yaml")]
    if rate != UNSHAPED:
        cmd += ["--profile", "shaped"]
    run_env = {**os.environ, **env, **({"LINK_RATE": rate} if rate != UNSHAPED else {})}
    return subprocess.run(
        [*cmd, *args], env=run_env, capture_output=True, text=True, timeout=timeout, check=False
    )


def throughput(project, rate, env, timeout):
    """samples/s of one run at this rate: rank 0's epochs after the first, averaged."""
    compose(project, rate, env, "down", "--volumes", "--remove-orphans", timeout=120)
    try:
        up = ["up", "--abort-on-container-exit", "--exit-code-from", "node0"]
        proc = compose(project, rate, env, *up, timeout=timeout)
        logs = compose(project, rate, env, "logs", "--no-log-prefix", "node0", timeout=60).stdout
    finally:
        compose(project, rate, env, "down", "--volumes", "--remove-orphans", timeout=120)
    if proc.returncode != 0:
        sys.exit(f"error: the run at {rate} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    rates = [int(s) for epoch, s in SAMPLES_RE.findall(logs) if int(epoch) > 1]
    if not rates:
        sys.exit(f"error: no epoch after the first in node0's output at {rate}:\n{logs[-3000:]}")
    return statistics.mean(rates)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", nargs="+", default=["1gbit", "100mbit"], help="tc rates besides unshaped")
    parser.add_argument("--workload", choices=["tiny", "vision"], default="vision", help="default: vision")
    parser.add_argument("--nproc", type=int, default=1, help="processes per node (default 1)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs per run, 1st left out (default 2)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over all rates (default 1)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds one run may take (default 900)")
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error("--epochs must be at least 2: the first epoch is left out")
    env = {"WORKLOAD": args.workload, "NPROC_PER_NODE": str(args.nproc), "EPOCHS": str(args.epochs)}
    env["SAVE_EVERY"] = str(args.epochs)
    rates = [UNSHAPED, *args.rates]
    results = {rate: [] for rate in rates}
    for round_ in range(args.repeats):
        order = rates[round_ % len(rates) :] + rates[: round_ % len(rates)]
        for rate in order:
            results[rate].append(throughput(f"ddplinkbench{os.getpid()}", rate, env, args.timeout))
            print(f"round {round_ + 1}: {rate}: {results[rate][-1]:.0f} samples/s", flush=True)
    n = args.nproc
    print(f"\n{args.workload}, {n}+{n} processes, {args.epochs} epochs, {args.repeats} rounds")
    print(f"{'link':>10} {'samples/s':>10} {'vs unshaped':>12}")
    for rate in rates:
        ratio = statistics.mean(s / u for s, u in zip(results[rate], results[UNSHAPED], strict=True))
        print(f"{rate:>10} {statistics.mean(results[rate]):>10.0f} {ratio:>12.2f}")


if __name__ == "__main__":
    main()
