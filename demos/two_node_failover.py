"""Watch a two-node job survive losing a node: node1 killed after a snapshot, brought back, an account.

    make two-node-failover                        # Compose projects ddp-failover and ddp-failover-reference
    make two-node-failover FAILOVER_ARGS=--crash  # root: first a crash Docker heals by itself, then the kill

Runs the elastic two-node job of docs/docker.md (compose.yaml + compose/elastic.yaml: examples/multinode.py on
CPUs, torchrun --max-restarts=3 on each node) detached. As soon as node0 has logged the epoch of the first
snapshot, node1's container is killed (`docker kill`: the node is gone) and started again (`docker compose
start node1`: the node comes back); torchrun on node0 restarts its processes, both nodes meet in a new
rendezvous round and resume from the snapshot. With --crash, node1's main process is SIGKILLed from the host
first (a crash, which Docker's restart policy heals by itself), and the kill follows after the next snapshot.
Then the same job runs uninterrupted in a second project, and the two final snapshots are compared bit for
bit. Ends with a short account; exit status 1 when the job did not recover or the weights differ. Only the
standard library and the docker client are used. Both projects (containers, network, volume) are removed.
"""

import argparse
import os
import re
import signal
import sys
import time

from compose_project import Project, docker, wait_for

FILES = ["-f", "compose.yaml", "-f", "compose/elastic.yaml"]  # the job of `docker compose up`, elastic
REFERENCE_FILES = ["-f", "compose.yaml"]
SNAPSHOT = "/snapshots/multinode.pt"  # where the compose files have multinode.py save
EPOCH_RE = re.compile(r"^epoch (\d+)/\d+ \|.* \| world_size (\d+)$", re.M)  # the epoch and the world
RESUME_RE = re.compile(r"^resuming from \S+: (\d+) epochs already run", re.M)


def say(text):
    print(f"two-node failover: {text}", flush=True)


def last_epoch(log):
    """The last epoch node0's rank 0 logged since the job last resumed (0 before any)."""
    epochs = EPOCH_RE.findall(log.split("resuming from")[-1])
    return int(epochs[-1][0]) if epochs else 0


def after_snapshot(proj, resumes, save_every, total):
    """ "ready" once the job, resumed `resumes` times, has logged the epoch of a snapshot taken since (rank 0
    saves right after logging it); "ended" when node0 has exited before that; else None."""
    running = docker("inspect", "-f", "{{.State.Running}}", proj.container("node0"), deadline=proj.deadline)
    log = proj.log("node0")
    resumed = RESUME_RE.findall(log)
    if last_epoch(log) >= total:
        sys.exit("two-node failover: error: the job ended before node1 could be killed: raise --epochs")
    if len(resumed) >= resumes and last_epoch(log) >= (int(resumed[-1]) if resumes else 0) + save_every:
        return "ready"
    return "ended" if running != "true" else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", default="ddp-failover", help="Compose project of the job")
    parser.add_argument("--reference_project", help="of the uninterrupted run (default: PROJECT-reference)")
    parser.add_argument("--image", default=os.environ.get("DDP_IMAGE", "ddp-examples:latest"))
    parser.add_argument("--epochs", type=int, default=40, help="epochs of the job (default 40)")
    parser.add_argument("--save_every", type=int, default=5, help="a snapshot every this many (default 5)")
    parser.add_argument("--crash", action="store_true", help="first SIGKILL node1's main process (root)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for everything (default 900)")
    args = parser.parse_args()
    if args.epochs <= 0 or args.save_every <= 0 or args.timeout <= 0:
        parser.error("--epochs, --save_every and --timeout must be positive")
    if args.epochs < 3 * args.save_every:
        parser.error(f"--epochs must be at least 3 x --save_every ({3 * args.save_every}): room to fail")
    if args.crash and os.geteuid() != 0:
        parser.error("--crash kills a container's process from the host: run as root")
    deadline = time.monotonic() + args.timeout
    env = {
        **os.environ,
        "DDP_IMAGE": args.image,
        "EPOCHS": str(args.epochs),
        "SAVE_EVERY": str(args.save_every),
    }
    proj = Project(args.project, FILES, env, deadline)
    reference = Project(args.reference_project or f"{args.project}-reference", REFERENCE_FILES, env, deadline)
    for p in (proj, reference):
        p.down()  # start fresh: no snapshot left on a volume from an earlier run
    try:
        account = failover(args, proj, deadline)
        if account["ok"]:
            say(f"the same job uninterrupted, for comparison, in project {reference.name}")
            up = reference("up", "--abort-on-container-exit", "--exit-code-from", "node0", check=False)
            if up.returncode:
                sys.exit(f"two-node failover: error: the uninterrupted run failed:\n{up.stdout[-3000:]}")
            same = proj.digest("node1", SNAPSHOT) == reference.digest("node1", SNAPSHOT)
            account["lines"].append(
                f"final weights {'equal' if same else 'DIFFER from'} an uninterrupted run's, bit for bit"
            )
            account["ok"] = same
        else:
            account["lines"].append(
                "the job did not recover (node0's log above says why): weights not compared"
            )
    finally:
        for p in (proj, reference):
            p.down()
    print("two-node failover, in short:")
    for line in account["lines"]:
        print(f"  {line}")
    sys.exit(0 if account["ok"] else 1)


def fail(how, node1, proj, deadline):
    """Kill node1 as `how` says and see it back; return what happened and how it came back, in words."""
    if how == "crash":
        pid = int(docker("inspect", "-f", "{{.State.Pid}}", node1, deadline=deadline))
        os.kill(pid, signal.SIGKILL)

        def restarted():
            return docker("inspect", "-f", "{{.RestartCount}}", node1, deadline=deadline) not in ("", "0")

        wait_for("Docker's restart of node1", restarted, min(deadline, time.monotonic() + 120))
        return (
            f"node1's main process (pid {pid}) was killed (SIGKILL)",
            "Docker restarted the container itself",
        )
    docker("kill", node1, deadline=deadline)
    docker("wait", node1, deadline=deadline)
    return "node1 was killed (docker kill)", "docker compose start node1 brought it back"


def failover(args, proj, deadline):
    """Run the elastic job with node1 lost (and crashed first, with --crash); return the account."""
    job = f"EPOCHS={args.epochs} SAVE_EVERY={args.save_every}"
    say(f"{job} docker compose -p {args.project} {' '.join(FILES)} up -d")
    proj("up", "-d")
    stop_following = proj.follow()  # shown as it comes
    lines, failures = [], ["crash", "kill"] if args.crash else ["kill"]
    try:
        node1 = proj.container("node1")
        for resumes, how in enumerate(failures):

            def ready(resumes=resumes):
                return after_snapshot(proj, resumes, args.save_every, args.epochs)

            if wait_for("a snapshot", ready, deadline) == "ended":
                break
            did, back = fail(how, node1, proj, deadline)
            epoch = last_epoch(proj.log("node0"))  # the last one done: none completes without node1
            saved = epoch // args.save_every * args.save_every
            lines.append(f"{did} in epoch {epoch + 1}, after the snapshot of epoch {saved}; {back}")
            say(lines[-1])
            if how == "kill":
                proj("start", "node1")
        status = docker("wait", proj.container("node0"), deadline=deadline)
    finally:
        stop_following()
    log = proj.log("node0")
    resumed, logged = RESUME_RE.findall(log), EPOCH_RE.findall(log)
    epochs, worlds = [int(e) for e, _ in logged], [w for _, w in logged]
    if resumed:
        rounds = f"{len(resumed)} time(s), from the snapshot of epoch {', then '.join(resumed)}"
        lines.append(f"node0's torchrun restarted its processes; the nodes met again and resumed {rounds}")
    else:
        lines.append("the job never resumed: no new rendezvous round trained")
    end = f"epoch {epochs[-1]}/{args.epochs}" if epochs else "no epoch"
    world = f", world_size {worlds[-1]}" if worlds else ""  # both nodes' processes: --nnodes=2 is fixed
    lines.append(f"the job exited {status} at {end}{world}")
    ok = status == "0" and len(resumed) == len(failures) and epochs[-1:] == [args.epochs]
    return {"lines": lines, "ok": ok}


if __name__ == "__main__":
    main()
