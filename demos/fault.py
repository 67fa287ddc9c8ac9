"""Watch torchrun recover: the documented restart command, one worker killed after a snapshot, an account.

    make fault-demo                      # in runs/fault-demo: the killed run, then an uninterrupted one

Runs the restart command from the top of examples/multigpu_torchrun.py (with more samples, so that an epoch
lasts long enough to interrupt), SIGKILLs rank 1 (or --rank 0, the one that saves) as soon as the first
snapshot is on disk, lets torchrun restart the workers, then runs the same command uninterrupted in another
folder and compares the two final snapshots bit for bit, optimizer state included. Exit status 1 when the
run did not recover or the snapshots differ. When torchrun's agent itself dies of torch's error-file race
(TORCH_RACE below), it says so and runs the first part again.
"""

import argparse
import ast
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
LESSON = REPO / "examples" / "multigpu_torchrun.py"


def documented_command():
    """The `--max-restarts` line of the lesson's docstring, as the reader would copy it."""
    doc = ast.get_docstring(ast.parse(LESSON.read_text())).replace("\\\n", " ")
    line = next(line for line in doc.splitlines() if "--max-restarts" in line)
    return line.split("#")[0].strip()


def start(command, folder):
    """Start the command in folder (its own copy of the lesson), echoing and keeping its output."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    shutil.copy(LESSON, folder)
    words = shlex.split(command)
    variables = dict(word.split("=", 1) for word in words if re.match(r"^[A-Z_]+=", word))
    words = [word for word in words if not re.match(r"^[A-Z_]+=", word)]
    env = {**os.environ, **variables, "PYTHONUNBUFFERED": "1"}
    words[0] = str(Path(sys.executable).with_name("torchrun"))  # this environment's torchrun
    proc = subprocess.Popen(
        words, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []

    def pump():
        for line in proc.stdout:
            lines.append(line)
            print(f"  | {line}", end="", flush=True)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return proc, lines, thread


def worker_of_rank(agent, rank):
    """The pid of torchrun's worker with RANK=rank (a child of the agent), or None."""
    for entry in Path("/proc").iterdir():
        try:
            if (
                entry.name.isdigit()
                and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == agent
            ):
                environ = (entry / "environ").read_bytes().split(b"\0")
                if f"RANK={rank}".encode() in environ:
                    return int(entry.name)
        except (OSError, ValueError, IndexError):
            continue
    return None


def epochs_in(snapshot):
    try:
        return int(torch.load(snapshot, map_location="cpu", weights_only=True)["EPOCHS_RUN"])
    except Exception:  # not there yet, or being renamed into place
        return 0


# torchrun's agent SIGTERMs the surviving worker, then reads the error file that worker's @record may have
# been writing at that moment: found empty, it kills the agent itself (torch 2.13; the lesson is not at fault)
TORCH_RACE = "Failed to parse reply file"


def once_more_after_torch_race(attempt):
    """attempt() kills a worker under torchrun and returns (exit status, output, ...). When torchrun's agent
    itself died of TORCH_RACE, it runs once more, and says so; the demo and the tests that kill workers
    share it. A second death of the kind is the attempt's result."""
    result = attempt()
    if result[0] != 0 and TORCH_RACE in result[1]:
        said = "torchrun's agent died reading an error file a survivor was still writing (a race in torch)"
        print(f"{said}; once more", flush=True)
        result = attempt()
    return result


def interrupted_run(command, folder, snapshot, rank, timeout):
    """Start the command in folder, SIGKILL the rank once the first snapshot is on disk, wait for the end."""
    proc, lines, pump = start(command, folder)
    deadline, killed = time.monotonic() + timeout, None
    while proc.poll() is None and time.monotonic() < deadline:
        if killed is None and (saved := epochs_in(snapshot)):
            pid = worker_of_rank(proc.pid, rank)
            if pid:
                os.kill(pid, signal.SIGKILL)
                killed = (pid, saved)
                said = f"in epoch {saved + 1}, after the snapshot of epoch {saved}"
                print(f"fault demo: SIGKILL to rank {rank} (pid {pid}) {said}", flush=True)
        time.sleep(0.02)
    if proc.poll() is None:
        proc.kill()
        sys.exit(f"fault demo: error: the run did not end within --timeout {timeout:g} s")
    pump.join()
    if killed is None:
        sys.exit("fault demo: error: the run ended before a worker could be killed: raise --dataset_size")
    return proc.returncode, "".join(lines), killed


def same(a, b):
    """Two snapshots bit for bit: the weights, the optimizer's state (its momentum) and the epochs run."""
    try:
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    except AssertionError:
        return False
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="runs/fault-demo", help="where the two runs go (emptied first)")
    parser.add_argument("--dataset_size", type=int, default=32768, help="samples: the length of an epoch")
    parser.add_argument("--timeout", type=float, default=300, help="seconds each run may take")
    parser.add_argument("--rank", type=int, choices=(0, 1), default=1, help="the worker killed (0 saves)")
    args = parser.parse_args()
    if args.dataset_size <= 0 or args.timeout <= 0:
        parser.error("--dataset_size and --timeout must be positive")
    # momentum: the optimizer has a state of its own to save and restore
    command = f"{documented_command()} --dataset_size {args.dataset_size} --momentum 0.9"
    folder = Path(args.dir).resolve()
    snapshot = folder / "killed" / "multigpu_torchrun_snapshot.pt"
    print(f"fault demo: {command}", flush=True)
    code, out, killed = once_more_after_torch_race(
        lambda: interrupted_run(command, folder / "killed", snapshot, args.rank, args.timeout)
    )
    resumed = re.findall(r"resuming from \S+: (\d+) epochs already run", out)
    print(
        f"fault demo: the same command uninterrupted, for comparison, in {folder / 'uninterrupted'}",
        flush=True,
    )
    clean, _, clean_pump = start(command, folder / "uninterrupted")
    clean.wait(timeout=args.timeout)
    clean_pump.join()
    a = torch.load(snapshot, map_location="cpu", weights_only=True)
    b = torch.load(folder / "uninterrupted" / snapshot.name, map_location="cpu", weights_only=True)
    pid, saved = killed
    print("fault demo, in short:")
    held = f"the last snapshot held {saved} epochs"
    print(f"  rank {args.rank} (pid {pid}) was killed in epoch {saved + 1}; {held}")
    restarted = "torchrun restarted the workers" if resumed else "torchrun did not restart the workers"
    after = f"resumed from the snapshot of epoch {resumed[0]}" if resumed else "did not resume"
    print(f"  {restarted}; they {after}, and the run exited {code}")
    equal = same(a, b)
    said = "equal" if equal else "DIFFER from"
    print(f"  final weights and optimizer state {said} an uninterrupted run's, bit for bit")
    sys.exit(0 if code == 0 and resumed == [str(saved)] and equal else 1)


if __name__ == "__main__":
    main()
