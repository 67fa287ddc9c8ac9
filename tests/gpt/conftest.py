"""The GPT tests' fixtures: one corpus cache for the whole session, and a fork server in each worker."""

import os
import subprocess
import time

import pytest
from gpt_helpers import FORKSERVER, SERVER_ENV
from helpers import PYTHON, kill_group, popen, session_dir


@pytest.fixture(scope="session")
def cache():
    """One corpus cache for the session, shared by the workers: the standard library corpus is built once,
    by the first process that needs it, while the others wait on the trainer's own lock (data.file_lock)."""
    return session_dir("gpt-cache")


@pytest.fixture(scope="session", autouse=True)
def forkserver():
    """tests/programs/forkserver.py for this worker's GPT runs (gpt_helpers.run), stopped at its end: torch
    and the trainer imported once, not in each of some two hundred processes. Its own errors go to
    forkserver-PID.log in the session's folder."""
    path = session_dir("forkserver") / f"{os.getpid()}.sock"
    with open(path.with_suffix(".log"), "w") as log:
        server = popen(
            [PYTHON, FORKSERVER, "serve", path], env=SERVER_ENV, stdout=log, stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + 300
    while not path.exists():
        assert server.poll() is None, f"the fork server ended: {path.with_suffix('.log').read_text()[-3000:]}"
        assert time.monotonic() < deadline, "the fork server did not listen within 300 s"
        time.sleep(0.1)
    os.environ["FORKSERVER"] = str(path)
    yield
    del os.environ["FORKSERVER"]
    kill_group(server)
    server.wait()
