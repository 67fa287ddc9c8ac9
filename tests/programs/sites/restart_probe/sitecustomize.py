"""Loaded at start-up by every Python process with this folder on PYTHONPATH
(tests/lessons/test_fault_tolerance.py).

In a torchrun worker of the first round (TORCHELASTIC_RESTART_COUNT=0) whose RANK is PROBE_KILL_RANK, a
thread SIGKILLs the process as soon as PROBE_SNAPSHOT exists: a worker lost right after the first snapshot. In
a worker of the second round whose RANK is PROBE_LATE_RANK, start-up sleeps PROBE_LATE_SECONDS first: a peer
that does not come. Every worker prints its round and the rendezvous store it was given.
"""

import os
import signal
import threading
import time

env = os.environ
if "TORCHELASTIC_RESTART_COUNT" in env and "RANK" in env:
    restart, rank = env["TORCHELASTIC_RESTART_COUNT"], env["RANK"]
    print(f"[probe] rank {rank} round {restart} store {env['MASTER_ADDR']}:{env['MASTER_PORT']}", flush=True)
    if restart == "0" and rank == env.get("PROBE_KILL_RANK"):

        def kill_after_snapshot(path=env["PROBE_SNAPSHOT"]):
            while not os.path.exists(path):
                time.sleep(0.005)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=kill_after_snapshot, daemon=True).start()
    if restart == "1" and rank == env.get("PROBE_LATE_RANK"):
        time.sleep(float(env["PROBE_LATE_SECONDS"]))
