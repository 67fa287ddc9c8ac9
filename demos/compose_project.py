"""What the two-node demos share: a Compose project run from the repository's root with a deadline, the
docker client with one, the digest of a snapshot's weights, and polling until something happens or the
deadline passes."""

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Compose's terminal codes (it erases the line before "exited with code", even with --ansi never)
TERMINAL_CODE = re.compile(r"\r|\x1b\[[0-9;]*[A-Za-z]")
# The C++ stack c10 adds to some errors, in either of its forms (symbolized or not): the error's own line
# says what happened, and `docker compose logs` still has the rest.
CPP_FRAME = re.compile(
    r"\|\s*(frame #\d+: |#\d+ .* from \S+$|Exception raised from |C\+\+ CapturedTraceback:"
    r"|\[W.*symbolizing C\+\+ stack trace)"
)
DIGEST = (  # the model weights of a snapshot, as one sha256
    "import hashlib, torch; s = torch.load({path!r}, weights_only=True)['MODEL_STATE']; "
    "print(hashlib.sha256(b''.join(v.numpy().tobytes() for _, v in sorted(s.items()))).hexdigest())"
)


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

    def digest(self, service, path):
        """The digest of the weights in the snapshot at path, read in a one-off container of the service
        (its volumes, not its dependencies)."""
        run = ["run", "--rm", "--no-deps", "--entrypoint", "python", service, "-c", DIGEST.format(path=path)]
        return self(*run).stdout.split()[-1]

    def log(self, service):
        """What the service's container printed (stdout and stderr) so far."""
        cmd = ["docker", "logs", self.container(service)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=self.left())
        return out.stdout + out.stderr

    def follow(self, *services):
        """Show the services' output as it comes, without terminal codes or C++ frames; stop() ends it."""
        proc = subprocess.Popen(
            [*self.cmd, "logs", "--follow", *services], cwd=REPO, env=self.env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, errors="replace",
        )  # fmt: skip

        def show():
            for line in proc.stdout:
                print(shown(line), end="", flush=True)

        thread = threading.Thread(target=show, daemon=True)
        thread.start()

        def stop():
            proc.terminate()
            proc.wait(timeout=30)
            thread.join(10)

        return stop

    def down(self):
        self("down", "--volumes", "--remove-orphans", "--timeout", "5", check=False)


def shown(line):
    """A line of the containers' output as the demos show it: "" for a C++ frame, no terminal codes."""
    return "" if CPP_FRAME.search(line) else TERMINAL_CODE.sub("", line)


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
