"""torchrun's worker environment for N ranks forked from this one process, which imports torch and the GPT
trainer (examples/gpt/train.py, when the script's folder or PYTHONPATH has it) once: how the GPT tests start
the runs whose subject is not the launcher (each process that imports torch costs 2-3 CPU seconds on 2
cores, and torchrun's agent and N workers are N + 1 of them). Restarts, signals, torchrun's closing summary
and rendezvous are torchrun's: those tests use it.

    python forkrun.py --nproc-per-node=N SCRIPT ARGS...

Each rank runs SCRIPT as __main__ with RANK, LOCAL_RANK, WORLD_SIZE and the rest set as torchrun sets them,
and meets the others at a TCP store that this process hosts (TORCHELASTIC_USE_AGENT_STORE, as torchrun's
agent does), on a port the system chose and held from the start. When a rank fails, the others get SIGTERM,
then SIGKILL 10 s later; the exit status is the first failure's (128 + N for signal N), else 0."""

import os
import runpy
import signal
import socket
import sys
import traceback

GRACE = 10  # seconds between SIGTERM and SIGKILL for the ranks left when one failed


def run_rank(script, args, env):
    """This process as one rank: SCRIPT as __main__; never returns."""
    os.environ.update(env)
    sys.argv = [script, *args]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if isinstance(stop.code, int) or stop.code is None:
            code = stop.code or 0
        else:  # sys.exit("message"): said, as the interpreter says it
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main():
    if len(sys.argv) < 3 or not sys.argv[1].startswith("--nproc-per-node="):
        sys.exit("usage: forkrun.py --nproc-per-node=N SCRIPT ARGS...")
    nproc = int(sys.argv[1].split("=", 1)[1])
    script, args = os.path.abspath(sys.argv[2]), sys.argv[3:]
    sys.path.insert(0, os.path.dirname(script))  # as `python SCRIPT` has it
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it for more than one process
    import torch.distributed as dist

    try:  # the GPT trainer and all it imports, here once for every rank; its scripts run it as __main__
        import train  # noqa: F401
    except ImportError:  # not on the path: a script of its own
        pass
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    common = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "ROLE_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "ROLE_NAME": "default",
        "TORCHELASTIC_RUN_ID": "forkrun",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    sys.stdout.flush()
    ranks = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            listener.close()
            run_rank(
                script, args, {**common, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}
            )
        ranks[pid] = rank
    store = dist.TCPStore(  # noqa: F841  (held until every rank has ended)
        "127.0.0.1", port, nproc, True, master_listen_fd=listener.fileno(), wait_for_workers=False
    )

    def end_all(signum, frame):
        for pid in ranks:
            os.kill(pid, signum)

    signal.signal(signal.SIGTERM, end_all)  # a signal to the launcher reaches every rank, as torchrun's does
    signal.signal(signal.SIGINT, end_all)
    signal.signal(signal.SIGALRM, lambda signum, frame: end_all(signal.SIGKILL, frame))
    failed = None
    while ranks:
        pid, status = os.wait()
        rank = ranks.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code and failed is None:
            failed = code if code > 0 else 128 - code
            print(
                f"forkrun: rank {rank} exited with {failed}; ending the others", file=sys.stderr, flush=True
            )
            end_all(signal.SIGTERM, None)
            signal.alarm(GRACE)
    sys.exit(failed or 0)


if __name__ == "__main__":
    main()
