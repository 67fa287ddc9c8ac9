"""pytest's hooks and the suite's shared fixture: each test's bound, processes left alive, skips CI does not
allow, the session's folder removed at its end; what each test costs (tests/costs.py). The helpers the test
files import are tests/helpers.py's."""

import os
import shutil
import signal
import subprocess
import time

import helpers
import pytest
import pytest_timeout
from helpers import (
    EXAMPLES,
    EXIT_PROBE,
    REFERENCE_ARGS,
    REFERENCE_BATCH,
    REFERENCE_EPOCHS,
    RUN_ID,
    SESSION_VAR,
    example_cmd,
    leftover_processes,
    once_per_session,
    run,
    session_dir,
    session_root,
)

# what each test costs, and the order the workers take them in (tests/costs.py)
pytest_plugins = ["costs"]


@pytest.fixture(scope="session")
def single_gpu_reference():
    """(folder, output) of single_gpu.py run from a copy alone in an empty folder (so nothing else can be
    imported), REFERENCE_EPOCHS epochs of the global batch REFERENCE_BATCH, a snapshot every 2: once in
    the session, for every worker."""

    def make(folder):
        script = shutil.copy(EXAMPLES / "single_gpu.py", folder)
        args = [REFERENCE_EPOCHS, 2, "--batch_size", REFERENCE_BATCH, *REFERENCE_ARGS]
        return run(
            example_cmd("single_gpu", *args, script=script), timeout=300, cwd=folder, env=EXIT_PROBE
        ).stdout

    folder, out = once_per_session("single_gpu_reference", make)
    return folder, subprocess.CompletedProcess([], 0, out)


# ---- session hooks: the bound of each test, processes left alive, skips that CI does not allow ----


def pytest_configure(config):
    """Mark the session, once: pytest-xdist's workers keep the mark of the session that started them, so that
    one check at its end finds a process that any worker's tests left, and share its folder (session_dir).
    Every compile of the session shares one inductor cache and compiles in the process that asks (no
    helper processes, which import torch again, on 2 cores)."""
    if not hasattr(config, "workerinput"):
        os.environ[SESSION_VAR] = f"{os.getpid()}-{RUN_ID}"
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(session_dir("inductor")))


def pytest_collection_modifyitems(items):
    """The tests marked gpu skip where torch sees no GPU (CI); everywhere else they run."""
    for item in items:
        if item.get_closest_marker("gpu") and not helpers.GPUS:
            item.add_marker(pytest.mark.skip(reason="no CUDA GPU visible to torch"))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # A test run in this process may leave Ctrl-C or SIGTERM ignored or blocked here, and every process the
    # next tests start would inherit it (whole runs found a lesson deaf to Ctrl-C, and prepare's pool
    # workers deaf to their pool's SIGTERM): each test starts from the signal state a shell gives.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    timeout = pytest_timeout._get_item_settings(item).timeout
    helpers.deadline[0] = time.monotonic() + timeout if timeout else float("inf")


_skips = []  # (test id, reason) of every skipped test


def pytest_runtest_logreport(report):
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skips.append((report.nodeid, reason.removeprefix("Skipped: ")))


@pytest.hookimpl(trylast=True)  # after pytest-xdist has stopped its workers, which carry the mark too
def pytest_sessionfinish(session):
    """Fail the session if a process it started is still alive 10 s after the last test (and kill it), and
    with REQUIRE_NO_SKIPS=1 (CI) if a test skipped for a reason that names no GPU. Under pytest-xdist the
    session that started the workers checks, once they have stopped."""
    if hasattr(session.config, "workerinput"):
        return
    left = leftover_processes()
    shutil.rmtree(session_root(), ignore_errors=True)
    write = session.config.get_terminal_writer().line
    if left:
        write(f"\nFAILED: {len(left)} process(es) started by the tests still alive at the end:", red=True)
        for pid, cmdline in left:
            write(f"  pid {pid}: {cmdline[:300]}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    banned = [(test, reason) for test, reason in _skips if "GPU" not in reason]
    if os.environ.get("REQUIRE_NO_SKIPS") == "1" and banned:
        write(f"\nFAILED: {len(banned)} skipped; with REQUIRE_NO_SKIPS=1 only GPU tests may:", red=True)
        for test, reason in banned:
            write(f"  {test}: {reason}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
