"""A Ray cluster on this machine for as long as one command runs: what `make ray` and the tests use.

    python harness/ray_local.py --num-cpus 2 -- python examples/multigpu_ray.py 10 5 --nproc 2

Starts a Ray head (`ray start --head --block`) on free ports with a folder of its own under the temporary
directory, waits at most --timeout seconds for it, runs the command with RAY_ADDRESS set to the head, then
stops the head however the command ended: by its process id and process group, never with `ray stop`,
which would end every Ray on the machine. The exit status is the command's.
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from steps import free_port

READY = "Ray runtime started"  # what `ray start` prints once the head takes work
# Once a cluster started by ray.init() has saved a token in ~/.ray/auth_token, `ray start` turns token
# authentication on while a driver given an address sends none, and is refused (InvalidAuthToken). This
# cluster serves one command on this machine: authentication off for the head and that command alike.
AUTH_ENV = {"RAY_AUTH_MODE": "disabled"}


class LocalRay:
    """A Ray head offering num_cpus CPUs (and the GPUs Ray finds) at .address; stop() ends it, all of it."""

    def __init__(self, num_cpus=2, timeout=120):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.folder = tempfile.mkdtemp(prefix="ray-")
        ray = Path(sys.executable).parent / "ray"
        ports = {  # the defaults are fixed numbers: a second Ray on the machine would collide
            "--dashboard-port": free_port(),
            "--dashboard-agent-listen-port": free_port(),
        }
        cmd = [
            ray, "start", "--head", "--block", f"--port={self.port}", f"--num-cpus={num_cpus}",
            "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={self.folder}",
            *(f"{name}={port}" for name, port in ports.items()),
        ]  # fmt: skip
        # no 30 s "drain" on SIGTERM: nothing here needs it; AUTH_ENV: see below
        env = {**os.environ, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", **AUTH_ENV}
        self.log = Path(self.folder) / "start.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while READY not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                code = self.proc.poll()
                why = f"exited with status {code}" if code is not None else f"did not start in {timeout:g} s"
                tail = self.log.read_text(errors="replace")[-3000:]
                self.stop()
                raise RuntimeError(f"the Ray head on port {self.port} {why}:\n{tail}")
            time.sleep(0.5)

    def stop(self, timeout=60):
        """End the head (SIGTERM: it stops the processes it started), then whatever is left of its group."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # the head's process group: everything it started that did not exit with it
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def stop_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # so that the finally below stops the head


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], usage="%(prog)s [--num-cpus N] [--timeout S] -- COMMAND ..."
    )
    parser.add_argument("--num-cpus", type=int, default=2, help="CPUs the head offers (default 2)")
    parser.add_argument("--timeout", type=float, default=120, help="seconds to wait for the head to start")
    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args, command = parser.parse_args(argv[:split]), argv[split + 1 :]
    if not command:
        parser.error("no command to run: ... -- COMMAND")
    if args.num_cpus < 1:
        parser.error(f"--num-cpus must be positive, got {args.num_cpus}")
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    start = time.monotonic()
    try:
        ray = LocalRay(args.num_cpus, args.timeout)
    except RuntimeError as exc:
        sys.exit(f"error: {exc}")
    print(f"Ray head at {ray.address} ({ray.folder}), up in {time.monotonic() - start:.0f} s", flush=True)
    try:
        return subprocess.call(command, env={**os.environ, "RAY_ADDRESS": ray.address, **AUTH_ENV})
    finally:
        ray.stop()
        print(f"Ray head at {ray.address} stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
