"""torchft replica groups in two containers: node1 killed, started again, healed from node0; an account.

    make two-node-torchft                           # Compose project ddp-torchft (compose/torchft.yaml)
    make two-node-torchft TORCHFT_ARGS="--kill_epoch 10 --epochs 60"

Runs compose/torchft.yaml detached: a lighthouse, and examples/multigpu_torchft.py as replica groups 0 and 1
in the containers node0 and node1. Once node0 has logged --kill_epoch epochs, node1 is killed (`docker compose
kill node1`: the node is gone) and node0 trains on alone; once it has logged --alone epochs so, node1 is
started again (`docker compose start node1`) and takes node0's live state (weights, optimizer, step) instead
of starting over. The account at the end: node0's world size epoch by epoch, the seconds from the kill to
node0's next epoch and from node1's start to its heal, the epoch node1 went on from, the check of the
weights, every container's exit code. Exit status 1 when a container failed, node0 went back or resumed,
node1 did not heal, or the weights in their last snapshots differ (digests read by runs of the image).
Only the standard library and the docker client are used here; the project (containers, network, volumes)
is removed at the end.
"""

import argparse
import os
import re
import sys
import time
import urllib.request
from datetime import datetime

from compose_project import Project, docker, wait_for

WHO = "two-node torchft"
FILES = ["-f", "compose/torchft.yaml"]
SERVICES = ["lighthouse", "node0", "node1"]
STAMP_RE = re.compile(r"^(\S+)Z (.*)$")  # a line of `logs --timestamps`: the time (UTC), then the text
EPOCH_RE = re.compile(r"^epoch (\d+)/(\d+) \|.*\| world_size (\d+)$")
HEAL_RE = re.compile(r'"GET /checkpoint/(\d+)/full HTTP')  # node0 serving its state to a healing group
SNAPSHOT = "/snapshots/multigpu_torchft.pt"  # each node's, on its own volume
START = "[group 1/2] "  # the first line a start of node1 prints


def say(text):
    print(f"{WHO}: {text}", flush=True)


def lines(proj, service):
    """(seconds since the epoch, text) of each line the service's container printed, in every start."""
    out = proj("logs", "--timestamps", "--no-log-prefix", service).stdout
    found = []
    for line in out.splitlines():
        if stamp := STAMP_RE.match(line):
            when = datetime.fromisoformat(stamp[1][:26] + "+00:00").timestamp()  # to microseconds
            found.append((when, stamp[2]))
    return sorted(found, key=lambda item: item[0])


def epochs(found):
    """(time, epoch, world size) of each epoch line."""
    return [(t, int(m[1]), int(m[3])) for t, text in found if (m := EPOCH_RE.match(text))]


def running(proj, service):
    state = "{{.State.Running}}"
    return docker("inspect", "-f", state, proj.container(service), deadline=proj.deadline) == "true"


def status_page(port):
    """The lighthouse's status page (quorum, heartbeats) as text without tags; '' if it did not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as page:
            html = page.read().decode()
    except OSError:
        return ""
    return " ".join(re.sub(r"<[^>]*>", " ", html).split())


def until(proj, what, condition):
    """Wait for condition(node0's lines); end the run with node0's last lines if node0 exits first."""

    def check():
        found = lines(proj, "node0")
        if result := condition(found):
            return result
        if not running(proj, "node0"):
            texts = [text for _, text in found]  # from the worker's traceback on, torchrun's after it
            first = next((i for i, text in enumerate(texts) if text.startswith("Traceback")), -25)
            tail = "\n".join(texts[first:][:40])
            sys.exit(f"{WHO}: error: node0 exited before {what}:\n{tail}")
        return None

    return wait_for(what, check, proj.deadline, who=WHO, every=1)  # each look runs 3 docker commands


def runs(sizes):
    """'2 (epochs 1-5), 1 (6-9), 2 (10-40)' from [(epoch, world size)]."""
    parts, first = [], 0
    for i, (epoch, size) in enumerate(sizes):
        if i + 1 == len(sizes) or sizes[i + 1][1] != size:
            span = f"{sizes[first][0]}-{epoch}" if epoch != sizes[first][0] else f"{epoch}"
            parts.append(f"{size} ({'epochs ' if not parts else ''}{span})")
            first = i + 1
    return ", ".join(parts)


def scenario(args, proj):
    """Run the job with node1 killed and started again; return the account and whether it went well."""
    say(f"docker compose -p {proj.name} {' '.join(FILES)} up -d")
    proj("up", "-d")
    stop_following = proj.follow("node0", "node1")
    account = []

    def both():  # the page once it lists both groups as members of a quorum
        page = status_page(args.port)
        return page if "Manager: http://node0:" in page and "Manager: http://node1:" in page else None

    try:
        page = wait_for("the status page listing node0 and node1", both, proj.deadline, who=WHO)
        quorum = re.search(r"Previous quorum id: (\d+)", page)
        account.append(
            f"the lighthouse's status page, http://localhost:{args.port}/status, showed node0 and node1 in "
            f"quorum {quorum[1] if quorum else '?'}"
        )

        def both_in(found):  # node0 has trained --kill_epoch epochs, the last one with node1
            done = epochs(found)
            return len(done) >= args.kill_epoch and done[-1][2] == 2

        until(proj, f"node0's epoch {args.kill_epoch} with node1", both_in)
        killed = time.time()
        proj("kill", "node1")
        before = epochs(lines(proj, "node1"))[-1][1]  # node1's last epoch: it dies in the next one
        say(f"node1 killed after its epoch {before}")

        def alone(found):
            return len([e for e in epochs(found) if e[1] > before and e[2] == 1]) >= args.alone

        until(proj, f"{args.alone} epochs of node0 alone", alone)
        proj("start", "node1")
        started = time.time()
        say("node1 started again")

        def back(found):  # node0 in a quorum of 2 again
            return any(t > started and size == 2 for t, _, size in epochs(found))

        until(proj, "node0 back in a quorum of 2", back)
        for service in SERVICES:  # node0 and node1 end, then the lighthouse: it stops when both are gone
            docker("wait", proj.container(service), deadline=proj.deadline)
    finally:
        stop_following()
    node0, node1 = lines(proj, "node0"), lines(proj, "node1")
    ran0 = epochs(node0)
    sizes = [(epoch, size) for _, epoch, size in ran0]
    account.append(f"node0's world size by epoch: {runs(sizes)}")
    after = [(t, e) for t, e, _ in ran0 if t > killed]
    if after:
        account.append(f"node0 logged epoch {after[0][1]} {after[0][0] - killed:.1f} s after node1's kill")
    restarts = [i for i, (_, text) in enumerate(node1) if text.startswith(START)]
    ran1 = epochs(node1[restarts[-1] :]) if len(restarts) > 1 else []  # since the start after the kill
    heals = [(t, int(m[1])) for t, text in node0 if t > started and (m := HEAL_RE.search(text))]
    if heals:
        step = heals[0][1]
        account.append(
            f"node1 took node0's live state at step {step} (epoch {step // args.steps + 1}) "
            f"{heals[0][0] - started:.1f} s after its start"
        )
    if ran1:
        account.append(f"node1's first epoch after its start: {ran1[0][1]} (killed after {before})")
    same = 1 + (proj.digest("node0", SNAPSHOT) == proj.digest("node1", SNAPSHOT))
    ends = [ran[-1][1] if ran else 0 for ran in (ran0, ran1)]
    account.append(f"node0 and node1 ended at epochs {ends[0]} and {ends[1]} of {args.epochs}")
    account.append(f"their last snapshots: weights identical on {same} of 2 groups")
    codes = {s: docker("inspect", "-f", "{{.State.ExitCode}}", proj.container(s), deadline=proj.deadline)
             for s in SERVICES}  # fmt: skip
    account.append("exit codes: " + ", ".join(f"{s} {code}" for s, code in codes.items()))
    steps = [epoch for epoch, _ in sizes]
    checks = {
        "every container exited 0": set(codes.values()) == {"0"},
        "node0's epochs went on one by one": steps == list(range(steps[0], steps[0] + len(steps))),
        "node0 never resumed from a snapshot": not any(text.startswith("resuming from") for _, text in node0),
        "node1 healed and went on from a later epoch": bool(heals and ran1) and ran1[0][1] > before,
        "both ended at the last epoch": ends == [args.epochs, args.epochs],
        "the weights were identical": same == 2,
    }
    failed = [check for check, passed in checks.items() if not passed]
    account += [f"NOT: {check}" for check in failed]
    ok = not failed
    return account, ok


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", default="ddp-torchft", help="Compose project (default ddp-torchft)")
    parser.add_argument("--image", default=os.environ.get("DDP_IMAGE", "ddp-examples:latest"))
    parser.add_argument("--epochs", type=int, default=40, help="epochs of the job (default 40)")
    parser.add_argument("--dataset_size", type=int, default=16384, help="samples (default 16384)")
    parser.add_argument("--kill_epoch", type=int, default=5, help="kill node1 after this epoch (default 5)")
    parser.add_argument("--alone", type=int, default=2, help="epochs node0 trains alone (default 2)")
    port = int(os.environ.get("TORCHFT_PORT", "29510"))
    parser.add_argument("--port", type=int, default=port, help="the status page's host port (TORCHFT_PORT)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for everything (default 600)")
    args = parser.parse_args()
    if min(args.epochs, args.dataset_size, args.kill_epoch, args.alone, args.port, args.timeout) <= 0:
        parser.error("--epochs, --dataset_size, --kill_epoch, --alone, --port and --timeout must be positive")
    if args.kill_epoch + args.alone >= args.epochs:
        parser.error(f"--epochs must be above --kill_epoch + --alone ({args.kill_epoch + args.alone})")
    args.steps = -(-args.dataset_size // 2 // 32)  # steps per epoch: half the samples each, 32 a batch
    env = {
        **os.environ,
        "DDP_IMAGE": args.image,
        "EPOCHS": str(args.epochs),
        "DATASET_SIZE": str(args.dataset_size),
        "TORCHFT_PORT": str(args.port),
    }
    proj = Project(args.project, FILES, env, time.monotonic() + args.timeout, who=WHO)
    proj.down()  # start fresh: no snapshot left on a volume from an earlier run
    try:
        account, ok = scenario(args, proj)
    finally:
        proj.down()
    print("two-node torchft, in short:")
    for line in account:
        print(f"  {line}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
