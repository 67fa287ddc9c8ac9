"""tests/programs/forkserver.py, through which the GPT tests run their Python command lines (gpt_helpers.run):
a run ends as `python SCRIPT ARGS` ends (its output, exit status or signal, folder, arguments and
environment), a signal to its client reaches it, and a client killed takes its run with it. Mutations: the
child's environment left as the server's, or the killed client's run left running: each fails here."""

import os
import signal
import subprocess
import time

import pytest
from gpt_helpers import FORKSERVER, run, run_as_is
from helpers import PYTHON, kill_group, popen

PROBE = """import os, sys, time
print(sys.argv[1], os.getcwd(), os.environ["PROBE"], sys.path[0] == os.path.dirname(__file__), flush=True)
if sys.argv[1] == "raise":
    raise ValueError("raised")
if sys.argv[1] == "wait":
    print(os.getpid(), flush=True)
    time.sleep(120)
sys.exit(3)
"""


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_a_run_through_the_fork_server_ends_as_python_would(tmp_path, how):
    (tmp_path / "probe.py").write_text(PROBE)
    cmd = [PYTHON, tmp_path / "probe.py", how]
    served = run(cmd, timeout=60, check=False, cwd=tmp_path, env={"PROBE": "given"})
    alone = run_as_is(cmd, timeout=60, check=False, cwd=tmp_path, env={"PROBE": "given"})
    assert served.args[1:4] == ["-I", "-S", str(FORKSERVER)]  # it went through the server
    assert served.returncode == alone.returncode == {"exit": 3, "raise": 1}[how]
    lines, expected = served.stdout.splitlines(), alone.stdout.splitlines()
    assert lines[0] == expected[0] == f"{how} {tmp_path} given True", lines
    assert lines[-1] == expected[-1], lines  # the traceback's last line: ValueError: raised


def gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(") ", 1)[1].startswith("Z")  # ended, not yet reaped
    except (FileNotFoundError, ProcessLookupError):  # reaped before the open, or between it and the read
        return True


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_signal_to_the_client_ends_its_run(tmp_path, signum):
    """SIGTERM is passed on (the client then ends as its run did); SIGKILL, which the client cannot pass
    on, ends it, and the server then kills the run."""
    (tmp_path / "probe.py").write_text(PROBE)
    cmd = [PYTHON, "-I", "-S", FORKSERVER, tmp_path / "probe.py", "wait"]
    client = popen(cmd, env={"PROBE": "given"}, cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout.readline().startswith("wait ")
        pid = int(client.stdout.readline())
        os.kill(client.pid, signum)
        assert client.wait(timeout=30) == -signum
        deadline = time.monotonic() + 10
        while not gone(pid):
            assert time.monotonic() < deadline, f"the run (pid {pid}) outlived its client"
            time.sleep(0.05)
    finally:
        kill_group(client)
