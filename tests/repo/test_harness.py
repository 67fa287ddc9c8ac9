"""The suite's own guarantees (tests/conftest.py): a command that runs past its bound is killed with every
process it started, and its bound ends before pytest-timeout's; processes left alive and skips CI forbids
fail the session, on pytest-xdist's workers too. Budget: about 45 s."""

import contextlib
import os
import signal
import time

import pytest
from helpers import PYTHON, REPO, SESSION_VAR, free_port, run

# a shell that starts two grandchildren, writes their process ids, and waits for them
TREE = 'sleep 300 & echo $! >> "$0"; sleep 300 & echo $! >> "$0"; wait'


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split(") ", 1)[1].startswith("Z")  # a zombie is gone


def environ_mark(pid):
    try:
        return [
            v for v in open(f"/proc/{pid}/environ", "rb").read().split(b"\0") if SESSION_VAR.encode() in v
        ]
    except OSError as exc:
        return repr(exc)


def test_a_command_past_its_bound_is_killed_with_its_whole_process_group(tmp_path):
    pids = tmp_path / "pids"
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="timed out after 2s"):
        run(["bash", "-c", TREE, pids], timeout=2)
    assert time.monotonic() - start < 10  # not held up by the grandchildren's hold on the output pipe
    children = [int(pid) for pid in pids.read_text().split()]
    assert len(children) == 2
    time.sleep(0.5)
    assert not [pid for pid in children if alive(pid)], "grandchildren outlived the timeout"


def test_a_process_the_tests_start_that_crashes_says_where():
    """A segmentation fault in a started Python process (here a read of address 0) prints every thread's
    Python stack into the output a failing test shows, with the function it was in. Mutation: popen
    without PYTHONFAULTHANDLER: the process dies by SIGSEGV silently and this fails."""
    program = "import ctypes\ndef reads_address_zero():\n    ctypes.string_at(0)\nreads_address_zero()\n"
    proc = run([PYTHON, "-c", program], timeout=60, check=False)
    assert proc.returncode == -11, proc.stdout
    assert "Fatal Python error: Segmentation fault" in proc.stdout, proc.stdout
    assert "line 3 in reads_address_zero" in proc.stdout, proc.stdout


@pytest.mark.timeout(20)
def test_a_bound_beyond_pytest_timeout_is_cut_to_end_before_it():
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="cut to end before pytest-timeout"):
        run(["sleep", "100"], timeout=100)
    assert time.monotonic() - start < 20 - 10  # 15 s before pytest-timeout's 20 s, with room for start-up


def test_free_ports_are_never_given_twice_and_nothing_listens():
    """Free ports are never handed out twice and nothing listens on them."""
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    assert all(port < low for port in ports), "below the ephemeral range"


# a session of the suite's own conftest: one test leaves a process behind, one skips for no GPU reason
LEAVES_AND_SKIPS = """
import os, subprocess, pytest
def test_leaves_a_process():
    sleep = subprocess.Popen(["sleep", "300"], start_new_session=True)
    open("left", "w").write(f"{sleep.pid} {os.environ['DDP_TEST_SESSION']}")
def test_skips():
    pytest.skip("no network")
"""


@pytest.mark.parametrize("jobs", ["0", "2"])
def test_a_process_left_alive_or_a_forbidden_skip_fails_the_session(tmp_path, jobs):
    """A process left alive or a skip CI forbids fails the session with or without workers.

    The suite's session rules hold whether make test runs it in one process (JOBS=0) or on pytest-xdist
    workers (JOBS=2): a process a test started and left running fails the session, named, and is killed;
    with REQUIRE_NO_SKIPS=1 a skip whose reason names no GPU fails it. Mutation: each worker marking its own
    processes (the old design, whose worker lists reached the session through pytest-xdist and twice in
    CI did not): with 2 workers the session passes and this fails."""
    (tmp_path / "test_leaves.py").write_text(LEAVES_AND_SKIPS)
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests"), "REQUIRE_NO_SKIPS": "1", "LEFTOVER_GRACE": "1"}
    env["RECORD_COSTS"] = "0"  # its sessions' tests are not the suite's: kept out of tests/costs.json
    cmd = [PYTHON, "-m", "pytest", "-p", "conftest", "-n", jobs, "-p", "no:cacheprovider", "test_leaves.py"]
    proc = run(cmd, timeout=120, check=False, env=env, cwd=tmp_path)
    left, mark = (tmp_path / "left").read_text().split()
    killed = not alive(int(left))
    # if the session missed it: was the process still there, and did it carry the mark its worker looked for?
    seen = f"pid {left} alive after the session: {not killed}; mark {mark}; its own: {environ_mark(left)}"
    with contextlib.suppress(ProcessLookupError):
        os.kill(int(left), signal.SIGKILL)  # not left behind by this test, whatever the session did
    assert proc.returncode == 1, proc.stdout
    assert "FAILED: 1 process(es) started by the tests still alive at the end:" in proc.stdout, (
        f"{seen}\n{proc.stdout}"
    )
    assert f"pid {left}: sleep 300" in proc.stdout, proc.stdout
    assert "test_leaves.py::test_skips: no network" in proc.stdout, proc.stdout
    assert killed, seen


def test_make_test_load_runs_beside_busy_processes_that_end_with_it(tmp_path):
    """`make test LOAD=N` runs the command beside busy processes that end with it.

    `make test LOAD=N` (harness/busy.py): while the command runs, N processes beside it (its siblings)
    use the CPU; when it ends they are gone, and its exit status is busy.py's. Mutation: the busy processes
    neither killed nor daemonic: busy.py never ends (timed out)."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import sys, time, psutil\n"
        "me = psutil.Process()\n"
        "busy = [p for p in me.parent().children() if p.pid != me.pid]\n"
        "open(sys.argv[1], 'w').write(' '.join(str(p.pid) for p in busy))\n"
        "time.sleep(1)\n"
        "sys.exit(3 if busy and all(p.cpu_times().user > 0 for p in busy) else 4)\n"
    )
    pids = tmp_path / "pids"
    proc = run(
        [PYTHON, REPO / "harness" / "busy.py", "2", "--", PYTHON, probe, pids], timeout=60, check=False
    )
    assert proc.returncode == 3, proc.stdout
    busy = [int(pid) for pid in pids.read_text().split()]
    assert len(busy) == 2 and not any(alive(pid) for pid in busy), busy


def test_make_clean_removes_the_corpora_cache_and_names_rays_own(tmp_path):
    """`make clean` removes the GPT corpora cache and names what Ray keeps.

    `make clean` also removes ~/.cache/ddp-examples (the GPT trainer's corpora, written outside the
    repository) and names Ray's folders instead of removing what other Ray programs share. Run in
    tmp_path with HOME and RUNS there, so that nothing of this machine's or the repository's is touched.
    Mutation: the cache left out of the rm: the first assertion fails."""
    home = tmp_path / "home"
    (home / ".cache" / "ddp-examples" / "gpt").mkdir(parents=True)
    (home / "ray_results").mkdir()
    runs = tmp_path / "runs"
    runs.mkdir()
    env = {**os.environ, "HOME": str(home)}
    env.pop("XDG_CACHE_HOME", None)
    # in tmp_path, so that the repository's own snapshots and caches stay
    (tmp_path / "mine_snapshot.pt").write_bytes(b"")
    proc = run(["make", "-f", REPO / "Makefile", "clean", f"RUNS={runs}"], timeout=60, env=env, cwd=tmp_path)
    assert not (home / ".cache" / "ddp-examples").exists() and not runs.exists(), proc.stdout
    assert f"kept {home / 'ray_results'}: Ray's" in proc.stdout
    assert (home / "ray_results").is_dir() and not (tmp_path / "mine_snapshot.pt").exists()
