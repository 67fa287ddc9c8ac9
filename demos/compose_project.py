"""What the two-node demos share: a Compose project run from the repository's root with a deadline, the
docker client with one, and polling until something happens or the deadline passes."""

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class Project:
    """One Compose project, run from the repository's root with the job's variables."""

    def __init__(self, name, files, env, deadline, who="two-node failover"):
        self.name, self.who = name, who  # who: what the error messages start with
        self.cmd, self.env, self.deadline = (
            ["docker", "compose", "--ansi", "never", "-p", name, *files],
            env,
            deadline,
        )

    def left(self):
        return max(1.0, self.deadline - time.monotonic())

    def __call__(self, *args, check=True, capture=True):
        try:
            proc = subprocess.run(
                [*self.cmd, *args], cwd=REPO, env=self.env, text=True, timeout=self.left(),
                stdout=subprocess.PIPE if capture else None, stderr=subprocess.STDOUT if capture else None,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            sys.exit(f"{self.who}: error: `{' '.join(args)}` did not end within --timeout")
        if check and proc.returncode:
            sys.exit(f"{self.who}: error: docker compose {' '.join(args)} failed:\n{proc.stdout or ''}")
        return proc

    def container(self, service):
        ids = self("ps", "-a", "-q", service).stdout.split()
        if not ids:
            sys.exit(f"{self.who}: error: no container for {service}")
        return ids[0]

    def log(self, service):
        """What the service's container printed (stdout and stderr) so far."""
        cmd = ["docker", "logs", self.container(service)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=self.left())
        return out.stdout + out.stderr

    def down(self):
        self("down", "--volumes", "--remove-orphans", "--timeout", "5", check=False)


def docker(*args, deadline):
    return subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=max(1.0, deadline - time.monotonic())
    ).stdout.strip()


def wait_for(what, condition, deadline, who="two-node failover", every=0.2):
    """Poll condition() every `every` s until it returns something true; end the run at the deadline."""
    while time.monotonic() < deadline:
        if result := condition():
            return result
        time.sleep(every)
    sys.exit(f"{who}: error: {what} did not happen within --timeout")
