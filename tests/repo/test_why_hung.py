"""Which process hangs where: on a collective's timeout every process still alive dumps its stack and its
flight recorder (examples/gpt/failures/hang.py), and tools/why_hung.py (`make why-hung RUN=...`) names the
process that is elsewhere, its collective and its line, and the processes that wrote nothing."""

import contextlib
import os
import signal
import subprocess
import time
from types import SimpleNamespace

import pytest
import why_hung as report_tool  # tools/why_hung.py
from helpers import (
    GPT_ON_PATH,
    GPU_ENV,
    GPUS,
    PROGRAMS,
    PYTHON,
    REPO,
    TORCHRUN,
    VENV,
    doc_block,
    kill_group,
    popen,
    run,
)

pytestmark = pytest.mark.timeout(240)

PITFALLS = REPO / "examples" / "pitfalls"


def why_hung(folder):
    proc = run([PYTHON, REPO / "tools" / "why_hung.py", folder], timeout=120, check=False)
    return proc.returncode, proc.stdout.strip().splitlines()


def broken_pitfall(name, tmp_path):
    """Run examples/pitfalls/NAME.py as it is: (its output lines, the folder of its dumps)."""
    proc = run([PYTHON, PITFALLS / f"{name}.py"], timeout=120, check=False, env={"TMPDIR": str(tmp_path)})
    lines = proc.stdout.splitlines()
    assert proc.returncode not in (0, None) and lines[-1].startswith("cause: "), lines[-10:]
    (folder,) = tmp_path.glob("why-hung-*")  # the script's dumps: TMPDIR/why-hung-PID/hang
    return lines, folder


def line_of(path, text):
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_mismatched_collectives_names_each_rank_and_its_collective(tmp_path):
    lines, folder = broken_pitfall("mismatched_collectives", tmp_path)
    here = "examples/pitfalls/mismatched_collectives.py"
    reduce, broadcast = (
        line_of(PITFALLS / "mismatched_collectives.py", f"dist.{op}(") for op in ("all_reduce", "broadcast")
    )
    code, report = why_hung(folder)
    assert code == 0, report
    verdict = (
        f"rank 1 calls broadcast #1 ({here}:{broadcast}) where rank 0 calls all_reduce #1 ({here}:{reduce})"
    )
    assert report[-1] == f"verdict: {verdict}", report
    assert "collective #1 of default_pg: entered by rank 0 (all_reduce), rank 1 (broadcast)" in report, report
    # torch's own analyser, on the same files, blames the same process
    assert any("torch's analyser" in line and "Culprit rank 1" in line for line in report), report
    assert lines[-1].startswith(f"cause: mismatched collectives: {verdict}; fix: "), lines[-1]


def test_silent_processes_lead_the_verdict_over_mixed_waits():
    """Silent processes lead the verdict though the others wait in different collectives.

    A paused node (seen in Docker): a ring all-reduce can end on rank 1, which got every chunk, while
    rank 0 still waits for one from the paused node; rank 1 is in the next collective. The silent ranks are
    the cause, named first; the others' places follow. With every process alive, the mismatch is the
    verdict, as before."""
    trainer, guards = "examples/gpt/trainer.py:157", "examples/gpt/failures/guards.py:24"
    last = {"default_pg": (45, "all_reduce", guards)}
    procs = {
        0: SimpleNamespace(rank=0, op="backward", where=trainer, header={"pid": 10}, doing="", newest={}),
        1: SimpleNamespace(rank=1, op="all_reduce", where=guards, header={"pid": 11}, doing="", newest=last),
    }
    apart = f"rank 1 calls all_reduce #45 ({guards}) where rank 0 calls backward ({trainer})"
    found = report_tool.verdict(procs, [2, 3], "")
    assert found == f"ranks 2, 3 {report_tool.MISSING}, while {apart}", found
    assert report_tool.verdict(procs, [], "") == apart


DOC_MARKER = "<!-- tests/repo/test_why_hung.py runs the next block as written -->"


def test_the_pitfall_and_report_block_of_troubleshooting_md_runs(tmp_path):
    """The pitfall and report block of troubleshooting.md runs as written.

    docs/troubleshooting.md's block, line by line, in a folder laid out as the repository's root: the
    pitfall (rank 0 sleeps outside any collective, and never times out itself; rank 1's timeout makes it
    dump through the store) exits 1 with its dumps in runs/why-hung-PID, and `make why-hung` on the folder
    the next line picks names rank 0, its host and its line, while rank 1 waits in the barrier; the
    pitfall's own last line says the same. Mutation: the block's RUN= pointing at runs/ (no hang/ there):
    make exits 2, saying it found no dumps, and the test fails."""
    for name in ("examples", "tools", "Makefile", "pins"):
        (tmp_path / name).symlink_to(REPO / name)
    (tmp_path / ".venv").symlink_to(VENV)
    env = {"PATH": f"{VENV / 'bin'}:{os.environ['PATH']}"}
    first, second = doc_block("docs/troubleshooting.md", DOC_MARKER).strip().splitlines()
    pitfall = run(["bash", "-c", first], timeout=120, check=False, cwd=tmp_path, env=env)
    assert pitfall.returncode == 1 and pitfall.stdout.splitlines()[-1].startswith("cause: "), pitfall.stdout
    assert len(list((tmp_path / "runs").glob("why-hung-*/hang/rank*.stack.txt"))) == 2, pitfall.stdout
    report = run(["bash", "-c", second], timeout=120, cwd=tmp_path, env=env).stdout.strip().splitlines()
    script = PITFALLS / "rank0_alone.py"
    sleep, barrier = line_of(script, "time.sleep(WORK"), line_of(script, "dist.monitored_barrier(")
    here = "examples/pitfalls/rank0_alone.py"
    assert f"rank 0 is outside any collective, at {here}:{sleep} (evaluate)" in report[-1], report
    assert f"rank 1 waits in monitored_barrier ({here}:{barrier})" in report[-1], report
    assert any(line.startswith(f"rank 0 ({os.uname().nodename}, pid ") for line in report), report
    cause = pitfall.stdout.splitlines()[-1]
    assert cause.startswith(f"cause: {report[-1].removeprefix('verdict: ')}: "), cause


def wait_for(path, seconds, proc):
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline and proc.poll() is None, f"no {path.name}: {proc.poll()}"
        time.sleep(0.2)
    return path.read_text()


def test_a_stopped_worker_under_torchrun_is_named_missing(tmp_path):
    """SIGSTOP one of torchrun's two workers: the other times out, dumps, and the report names the stopped
    one as the process that wrote nothing, and the collective the other waits in."""
    script = PROGRAMS / "why_hung_loop.py"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node=2", script, run_dir, "6"]
    proc = popen(cmd, cwd=tmp_path, env=GPT_ON_PATH, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(run_dir / "ready1", 90, proc)  # both workers are all-reducing
        os.kill(int((run_dir / "pid1").read_text()), signal.SIGSTOP)
        assert wait_for(run_dir / "done0", 60, proc) == "[1]"  # rank 0 waited for rank 1's dump in vain
    finally:
        # torchrun starts its workers in sessions of their own, and would wait 30 s for the stopped one
        for pid in run_dir.glob("pid*"):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid.read_text()), signal.SIGKILL)
        kill_group(proc)
        proc.wait(timeout=30)
    assert not (run_dir / "hang" / "rank1.stack.txt").exists()
    code, report = why_hung(run_dir)
    assert code == 0, report
    reduce = line_of(script, "dist.all_reduce(")
    assert report[-1].startswith("verdict: rank 1 wrote nothing (stopped, dead or unreachable"), report
    assert ", while rank 0 waits in all_reduce #" in report[-1] and f"loop.py:{reduce})" in report[-1], report
    assert "rank 1: wrote nothing (stopped, dead or unreachable, or not armed)" in report, report


def test_a_folder_without_dumps_is_refused_in_one_line(tmp_path):
    (tmp_path / "hang").mkdir()
    proc = subprocess.run(
        [PYTHON, REPO / "tools" / "why_hung.py", tmp_path], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and not proc.stdout, proc
    no_dumps = f"no dumps in {tmp_path / 'hang'} (rank*.stack.txt, fr_rank*): did a collective time out?"
    assert proc.stderr.strip() == f"why_hung.py: error: {no_dumps}", proc.stderr


@pytest.mark.skipif(GPUS < 2, reason=f"an NCCL timeout needs two ranks, one GPU each; torch sees {GPUS}")
def test_nccl_dumps_on_timeout_are_read_by_the_same_report(tmp_path):
    script = PROGRAMS / "nccl_alone.py"
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node=2", script, tmp_path / "run"]
    proc = run(cmd, timeout=150, check=False, cwd=tmp_path, env={**GPU_ENV, **GPT_ON_PATH})
    assert proc.returncode != 0, proc.stdout[-3000:]
    hang = tmp_path / "run" / "hang"
    assert (hang / "fr_rank0").exists() and (hang / "fr_rank1").exists(), proc.stdout[-3000:]  # NCCL's own
    code, report = why_hung(tmp_path / "run")
    assert code == 0, report
    sleep = line_of(script, "time.sleep(60)")
    assert f"rank 0 is outside any collective, at {script}:{sleep}" in report[-1], report
    assert "rank 1 waits in all_reduce #" in report[-1], report
