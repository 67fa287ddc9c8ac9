"""Bad input: an argparse-style message, exit status 2, and nothing written.

Most cases run a lesson's __main__ block in this interpreter (runpy), which parses and refuses in
milliseconds where a new interpreter takes seconds to import torch; a few per script start it for real.
"""

import runpy
import subprocess
import sys

import pytest
from helpers import EXAMPLES, PYTHON, TrainLog, example_cmd, run

pytestmark = pytest.mark.quick

CASES = [
    (["0", "1"], "total_epochs must be positive"),
    (["1", "0"], "save_every must be positive"),
    (["x", "1"], "invalid int value: 'x'"),
    (["1", "1", "--batch_size", "0"], "batch_size must be positive"),
    (["1", "1", "--lr", "fast"], "invalid float value: 'fast'"),
    (["1", "1", "--lr", "-1"], "lr must be positive"),
    (["1", "1", "--dataset_size", "0"], "dataset_size must be positive"),
    # non-finite numbers: each would train to NaN and exit 0
    (["1", "1", "--lr", "nan"], "lr must be positive and finite, got nan"),
    (["1", "1", "--lr", "inf"], "lr must be positive and finite, got inf"),
    (["1", "1", "--momentum", "nan"], "momentum must be 0 or more and finite, got nan"),
    (["1", "1", "--momentum", "-1"], "momentum must be 0 or more and finite, got -1"),
    (["1", "1", "--nproc", "2"], "unrecognized arguments: --nproc"),  # mp.spawn's option: multigpu.py only
    (["1", "1", "--batchsize", "8"], "unrecognized arguments: --batchsize 8 (did you mean --batch_size?)"),
    # before any epoch, not at the first save (every lesson's get_args: test_structure keeps them one)
    (["1", "1", "--snapshot_path", "missing/s.pt"], "snapshot_path: no folder missing to write in"),
]


def assert_rejected(proc, message, folder):
    assert proc.returncode == 2, proc.stdout
    assert "Traceback" not in proc.stdout
    assert_refused_early(proc, message, folder)


def assert_refused_early(proc, message, folder):
    """What holds under torchrun too, whose own exit status is 1 and which adds a traceback of its own."""
    assert "error:" in proc.stdout and message in proc.stdout, proc.stdout
    assert not TrainLog(proc.stdout).ranks, "refused before any process group formed"
    assert not list(folder.iterdir()), "bad input must not leave files behind"


@pytest.fixture
def in_process(tmp_path, monkeypatch, capsys):
    """run(script, args): the script's __main__ block run here, in tmp_path, as `python script args` would;
    its exit status and output as a CompletedProcess. An exception other than an exit fails the test."""

    def run_here(script, args):
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(sys, "argv", [str(script), *args])
        capsys.readouterr()
        with pytest.raises(SystemExit) as exited:
            runpy.run_path(str(script), run_name="__main__")
        out = capsys.readouterr()
        return subprocess.CompletedProcess([script, *args], exited.value.code, out.out + out.err)

    return run_here


@pytest.mark.parametrize(("args", "message"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_single_gpu_rejects(in_process, tmp_path, args, message):
    assert_rejected(in_process(EXAMPLES / "single_gpu.py", args), message, tmp_path)


@pytest.mark.parametrize(("args", "message"), [CASES[0], CASES[2]], ids=["total_epochs", "invalid int"])
def test_single_gpu_rejects_in_a_process_of_its_own(tmp_path, args, message):
    proc = run([PYTHON, EXAMPLES / "single_gpu.py", *args], timeout=120, check=False, cwd=tmp_path)
    assert_rejected(proc, message, tmp_path)


MULTIGPU_CASES = [
    (["1", "1", "--nproc", "0"], "--nproc must be at least 1, got 0"),  # on the CPU as on GPUs
    (["-3", "1"], "total_epochs must be positive"),
]


@pytest.mark.parametrize(("args", "message"), MULTIGPU_CASES)
def test_multigpu_rejects_before_spawning(in_process, tmp_path, args, message):
    assert_rejected(in_process(EXAMPLES / "multigpu.py", args), message, tmp_path)


def test_multigpu_rejects_in_a_process_of_its_own(tmp_path):
    args, message = MULTIGPU_CASES[0]
    proc = run([PYTHON, EXAMPLES / "multigpu.py", *args], timeout=120, check=False, cwd=tmp_path)
    assert_rejected(proc, message, tmp_path)


@pytest.mark.parametrize("name", ["multigpu_torchrun", "multinode", "multigpu_accelerate"])
def test_torchrun_examples_reject_a_plain_start_and_bad_numbers(in_process, tmp_path, name):
    # a plain start for real (torchrun's variables absent), bad numbers in process
    proc = run([PYTHON, EXAMPLES / f"{name}.py", "1", "1"], timeout=120, check=False, cwd=tmp_path)
    assert_rejected(proc, "start me with torchrun", tmp_path)


# This machine has no GPU: sitecustomize makes torch report one in every process, torchrun's included.
ONE_GPU = "import torch\ntorch.cuda.device_count = lambda: 1\n"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("multigpu", "--nproc must be between 1 and the number of GPUs, got 2"),
    ],
)
def test_more_processes_than_gpus_are_refused(tmp_path, name, message):
    site, work = tmp_path / "site", tmp_path / "work"
    site.mkdir()
    work.mkdir()
    (site / "sitecustomize.py").write_text(ONE_GPU)
    env = {"PYTHONPATH": str(site)}
    proc = run(example_cmd(name, "1", "1", nproc=2), env=env, timeout=120, check=False, cwd=work)
    assert proc.returncode == (2 if name == "multigpu" else 1), proc.stdout[-3000:]  # torchrun's status: 1
    assert_refused_early(proc, message, work)
    assert proc.stdout.count(message) == 1, proc.stdout[-3000:]  # torchrun: in its summary, not per process
