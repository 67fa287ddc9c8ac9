"""The CPU tests hide the GPUs one way, CUDA_VISIBLE_DEVICES='' (conftest.CPU_ENV), and what they start
honours it: torch, the lessons, the Makefile's GPUS (else counted by nvidia-smi, which ignores that variable)
and make doctor. tests/fake_gpus/nvidia-smi lists 8 GPUs on a machine without any; .ci/run also runs a
selection of the CPU tests with it first on PATH. Budget: a few seconds."""

import os
import re

from helpers import CPU_ENV, REPO, VENV, run

FAKE = REPO / "tests" / "fake_gpus"


def make_dry_run(target, *variables, env):
    cmd = ["make", "-n", "-C", REPO, target, f"VENV={VENV}", *variables]
    return run(cmd, timeout=60, env={"PATH": f"{FAKE}{os.pathsep}{os.environ['PATH']}", **env}).stdout


def test_make_counts_the_gpus_that_cuda_visible_devices_names():
    shown = make_dry_run("multinode", env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert re.search(r"steps\.py multinode --nproc 4 --gpus 4 ", shown), shown
    hidden = make_dry_run("multinode", env=CPU_ENV)  # what every CPU test passes
    assert re.search(r"steps\.py multinode --nproc 2 --gpus 0 ", hidden), hidden


def test_without_cuda_visible_devices_make_counts_what_nvidia_smi_lists():
    """The fake is what the suite's proof rests on: unhidden, make sees its 8 GPUs; GPUS=0 hides them too."""
    path = {"PATH": f"{FAKE}{os.pathsep}{os.environ['PATH']}"}
    cmd = ["env", "-u", "CUDA_VISIBLE_DEVICES", "make", "-n", "-C", REPO, "multigpu", f"VENV={VENV}"]
    listed = run(cmd, timeout=60, env=path).stdout
    assert re.search(r"steps\.py multigpu --nproc 8 --gpus 8 ", listed), listed
    zero = run([*cmd, "GPUS=0"], timeout=60, env=path).stdout
    assert re.search(r"steps\.py multigpu --nproc 2 --gpus 0 ", zero), zero


def test_doctor_reports_hidden_gpus_as_information_not_a_failure():
    path = {"PATH": f"{FAKE}{os.pathsep}{os.environ['PATH']}"}
    proc = run([VENV / "bin" / "python", REPO / "tools" / "doctor.py"], timeout=300, check=False, env=path)
    expected = "INFO  gpus         8 hidden by CUDA_VISIBLE_DEVICES='': the examples use the CPU and gloo"
    assert expected in proc.stdout, proc.stdout
    assert "FAIL  gpus" not in proc.stdout
