"""torchft on this machine: a lighthouse and replica groups, each a torchrun of examples/multigpu_torchft.py.

    make torchft                                    # a lighthouse and two groups, in runs/torchft
    make torchft FT_ARGS=--kill                     # the last group SIGKILLed, started again: it heals
    make torchft FT_ARGS="--kill --alone 2"         # ... the others train 2 epochs alone before its restart
    make torchft FT_ARGS="--kill --kill_joining"    # ... killed again as it takes the state, restarted
    make torchft FT_ARGS=--restart_lighthouse       # the lighthouse killed and started again mid-run

Each group runs in its own folder (its own snapshot, as on its own node). The lighthouse waits for every
group before a step: a killed group is started again at once, and the others wait for it (at most the
lesson's --timeout) and go on when it has taken their live state. With --alone N a quorum of one goes on
instead, and the killed group is started again once the others have trained N epochs without it: on a busy
machine they may then finish before it is back, which the account says. The account at the end says, per
group and start, the epochs it logged with the world size of each and how it ended, then what the failure
cost: the seconds from the kill to the survivors' next epoch, and the step and second a restarted group
took the live state at; --summary writes it as JSON. Exit status 0 when the last start of every group
exited 0 and the groups' last snapshots hold identical weights.
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "harness"))
from steps import free_port  # noqa: E402  (harness/steps.py)

LESSON = REPO / "examples" / "multigpu_torchft.py"
SNAPSHOT = "multigpu_torchft_snapshot.pt"  # the lesson's default, in each group's folder
BIN = Path(sys.executable).parent
EPOCH = re.compile(r"^epoch (\d+)/\d+ \| .* world_size (\d+)")
RESUMED = re.compile(r"^resuming from .*: (\d+) epochs already run")  # a snapshot read: its epochs
HEAL = re.compile(r'"GET /checkpoint/(\d+)/full HTTP')  # a group serving its live state to a healing one


class Process:
    """A command in its own process group, its output kept, and echoed with a prefix (not every epoch)."""

    def __init__(self, name, command, cwd, env):
        self.name, self.lines, self.times, self.started = name, [], [], time.monotonic()
        self.proc = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _pump(self):
        size = None
        for line in self.proc.stdout:
            self.times.append(time.monotonic())
            self.lines.append(line.rstrip("\n"))
            epoch = EPOCH.match(line)
            # shown: every line but the epochs, of which every 10th and each whose world size changed
            if epoch is None or int(epoch[1]) % 10 == 0 or epoch[2] != size:
                print(f"[{self.name}] {line}", end="", flush=True)
            size = epoch[2] if epoch else size

    def logged(self, since=0.0):
        """(time, epoch, world size) of each epoch logged after the time since."""
        found = zip(self.times, map(EPOCH.match, self.lines), strict=False)
        return [(t, int(m[1]), int(m[2])) for t, m in found if m and t > since]

    def epochs(self, since=0.0):
        return [(epoch, size) for _, epoch, size in self.logged(since)]

    def first(self, pattern, since=0.0):
        """(time, match) of the first line after since that pattern finds, or None."""
        found = zip(self.times, map(pattern.search, self.lines), strict=False)
        return next(((t, m) for t, m in found if m and t > since), None)

    def kill(self, say=False):
        """SIGKILL torchrun and its worker together, as a lost node loses both; say: as a line, now."""
        if say:
            print(f"[demo] SIGKILL to {self.name} and its processes, as when its node is lost", flush=True)
        if self.proc.poll() is None:  # torchrun starts its worker in a session of its own: kill both
            for process in [*psutil.Process(self.proc.pid).children(recursive=True), self.proc]:
                process.send_signal(signal.SIGKILL)
        return self.wait(10)

    def wait(self, timeout):
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self.thread.join(5)
        return self.proc.returncode


def wait_until(what, predicate, deadline):
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"error: gave up waiting for {what}")
        time.sleep(0.1)


def same_weights(root, groups):
    """How many groups' last snapshots hold group 0's weights, in a line: each group saves its own at the
    last epoch, so after a heal they match bit for bit."""
    snapshots = [root / f"group{n}" / SNAPSHOT for n in range(groups)]
    if not all(path.is_file() for path in snapshots):
        return "weights not compared: a group saved no snapshot"
    weights = [torch.load(path, weights_only=True)["MODEL_STATE"] for path in snapshots]
    same = sum(all(torch.equal(mine[k], weights[0][k]) for k in mine) for mine in weights)
    return f"weights identical on {same} of {groups} groups"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="runs/torchft", help="one folder per group under it")
    parser.add_argument("--groups", type=int, default=2, help="replica groups (default 2)")
    # 60: with --kill, the others still train when the killed group is back (its start takes 5 to 11 s)
    parser.add_argument("--epochs", type=int, default=60, help="epochs to train (default 60)")
    parser.add_argument("--save_every", type=int, default=5, help="snapshot every this many epochs")
    parser.add_argument("--dataset_size", type=int, default=8192, help="samples: 128 steps an epoch a group")
    parser.add_argument("--kill", action="store_true", help="SIGKILL the last group after --kill_epoch")
    parser.add_argument("--kill_epoch", type=int, default=5, help="the epoch after which to kill (default 5)")
    parser.add_argument("--kill_joining", action="store_true", help="kill it again as it takes the state")
    parser.add_argument("--alone", type=int, default=0, help="epochs the others train alone (default 0)")
    parser.add_argument("--restart_lighthouse", action="store_true", help="kill, restart the lighthouse")
    parser.add_argument("--down", type=float, default=3, help="seconds the lighthouse stays down")
    parser.add_argument("--timeout", type=float, default=60, help="the lesson's --timeout (default 60)")
    parser.add_argument("--deadline", type=float, default=300, help="seconds for the whole run")
    parser.add_argument("--summary", help="write the account as JSON to this file")
    args = parser.parse_args()
    if (
        args.groups < 1
        or args.epochs < 2
        or (args.kill or args.restart_lighthouse) > (args.kill_epoch < args.epochs)
    ):
        parser.error("needs --groups >= 1, --epochs >= 2, and --kill_epoch below --epochs")
    deadline = time.monotonic() + args.deadline
    port = free_port()
    env = {**os.environ, "RUST_LOG": "warn", "PYTHONUNBUFFERED": "1"}
    root = Path(args.dir).resolve()
    # the account below is of whole runs: each demo starts afresh (the lesson alone resumes)
    again = ", its last run removed" if root.exists() else ""
    print(f"[demo] {root}: started afresh{again}; the account counts whole runs", flush=True)
    shutil.rmtree(root, ignore_errors=True)
    # A quorum of every group: a group waits for the others, a killed one included. With --alone, a quorum
    # of one: the others go on without the killed group (and may finish before it is back).
    quorum = 1 if args.kill and args.alone else args.groups
    lighthouse_command = [
        str(BIN / "torchft_lighthouse"), "--min_replicas", str(quorum), "--join_timeout_ms", "1000",
        "--bind", f"127.0.0.1:{port}",
    ]  # fmt: skip

    def lighthouse():
        return Process("lighthouse", lighthouse_command, REPO, env)

    def group(n):
        folder = root / f"group{n}"
        folder.mkdir(parents=True, exist_ok=True)
        command = [
            str(BIN / "torchrun"), "--standalone", "--nproc-per-node=1", str(LESSON), str(args.epochs),
            str(args.save_every), "--replica_group", str(n), "--replica_groups", str(args.groups),
            "--dataset_size", str(args.dataset_size), "--timeout", str(args.timeout),
            "--lighthouse", f"http://127.0.0.1:{port}",
        ]  # fmt: skip
        return Process(f"group{n}", command, folder, env)

    starts = {n: [] for n in range(args.groups)}
    figures = []  # what the failure cost, in words, for the account
    house = lighthouse()
    try:
        for n in starts:
            starts[n].append(group(n))
        survivor, last = starts[0][0], args.groups - 1

        def alone(since):  # the survivor has logged --alone epochs without the killed group, or has ended
            def done():
                epochs = sum(size < args.groups for _, size in survivor.epochs(since))
                return epochs >= args.alone or survivor.proc.poll() is not None

            return done

        if args.kill or args.restart_lighthouse:
            # the first group to start trains alone until the others join: wait for them
            first = starts[last][0]

            def together():
                done = first.epochs()
                return len(done) >= args.kill_epoch and done[-1][1] == args.groups

            wait_until(f"epoch {args.kill_epoch} of all groups together", together, deadline)
        if args.kill:
            killed = time.monotonic()
            starts[last][0].kill(say=True)
            wait_until(f"{args.alone} epochs without group {last}", alone(killed), deadline)
            if args.kill_joining:  # killed again as it takes the live state: when the survivor serves it
                joining = group(last)
                starts[last].append(joining)
                wait_until("the state served", lambda: survivor.first(HEAL, joining.started), deadline)
                killed = time.monotonic()
                joining.kill(say=True)
                wait_until(f"{args.alone} epochs without group {last}", alone(killed), deadline)
            starts[last].append(group(last))
            ended = survivor.proc.poll
            wait_until(
                "group0's next epoch", lambda: survivor.logged(killed) or ended() is not None, deadline
            )
            for when, epoch, size in survivor.logged(killed)[:1]:
                figures.append(
                    f"group0 logged epoch {epoch} at world size {size}, {when - killed:.1f} s after the kill"
                )
        if args.restart_lighthouse:
            house.kill(say=True)
            time.sleep(args.down)
            house = lighthouse()
            for n in starts:  # the groups stop at their quorum timeout; started again, they resume
                starts[n][-1].wait(max(1, deadline - time.monotonic()))
                starts[n].append(group(n))
        for runs in starts.values():
            runs[-1].wait(max(1, deadline - time.monotonic()))
    finally:
        for runs in starts.values():
            for run in runs:
                run.kill()
        house.kill()
    back = starts[last][-1].started  # the killed group's last start
    if args.kill and (healed := survivor.first(HEAL, back)):
        step, seconds = int(healed[1][1]), healed[0] - back
        figures.append(f"group{last} took the live state at step {step}, {seconds:.1f} s after its start")
    elif args.kill:  # nobody left to heal from: it trained on alone, from its snapshot or from the start
        gap = survivor.times[-1] - back  # group0's last line, from the killed group's last start
        when = f"{gap:.1f} s after" if gap >= 0 else f"{-gap:.1f} s before"
        figures.append(
            f"group{last} took no live state: group0 ended {when} its last start, with nobody left to heal "
            "from; raise --epochs"
        )
    account = {
        f"group{n}": [
            {
                "returncode": run.proc.returncode,
                "epochs": run.epochs(),
                "resumed": next(map(int, (m[1] for m in map(RESUMED.match, run.lines) if m)), None),
                "no_quorum": any(line.startswith("no quorum of") for line in run.lines),
            }
            for run in runs
        ]
        for n, runs in starts.items()
    }
    identical = [same_weights(root, args.groups)]
    print("\naccount:")
    for name, runs in account.items():
        for i, run in enumerate(runs):
            sizes = sorted({size for _, size in run["epochs"]})
            span = f"epochs {run['epochs'][0][0]}-{run['epochs'][-1][0]}" if run["epochs"] else "no epoch"
            print(f"  {name} start {i + 1}: {span}, world sizes {sizes}, exit {run['returncode']}")
    print(f"  {identical[-1]}")
    for figure in figures:
        print(f"  {figure}")
    account.update(identical=identical, figures=figures)
    if args.summary:
        Path(args.summary).write_text(json.dumps(account, indent=1))
    ended = all(runs[-1].proc.returncode == 0 for runs in starts.values())
    same = identical[-1] == f"weights identical on {args.groups} of {args.groups} groups"
    return 0 if ended and same else 1


if __name__ == "__main__":
    sys.exit(main())
