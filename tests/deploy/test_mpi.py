"""examples/mpi/mpirun_env.sh: mpirun (Open MPI) starts the processes of a torchrun lesson, which meet over
env:// from OpenMPI's variables. .ci/run installs Debian's openmpi-bin (harness/apt_install.sh)."""

import os
import shutil
import subprocess

import pytest
import torch
from helpers import (
    EXAMPLES,
    PYTHON,
    REPO,
    TrainLog,
    free_port,
    load_snapshot,
    need,
    run,
    run_together,
    steps,
)

WRAPPER = EXAMPLES / "mpi" / "mpirun_env.sh"
ARGS = ["3", "1", "--dataset_size", "512", "--momentum", "0.9"]
# as root (CI, containers) Open MPI refuses to start unless told twice
ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


@pytest.fixture(scope="module")
def mpirun():
    path = shutil.which("mpirun")
    need(path, "no mpirun (harness/apt_install.sh openmpi-bin installs Open MPI)", "REQUIRE_MPI")
    return path


def mpi_command(mpirun, port, *args):
    env = ["-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={port}", "-x", f"PYTHON={PYTHON}"]
    return [
        mpirun,
        "-np",
        "4",
        "--oversubscribe",
        "--bind-to",
        "none",
        *env,
        WRAPPER,
        EXAMPLES / "multinode.py",
        *args,
    ]


def test_mpirun_trains_multinode_to_the_weights_of_two_torchrun_nodes(mpirun, tmp_path):
    """mpirun -np 4 through the wrapper: 4 ranks, each in its place (RANK, LOCAL_RANK and the node from
    OpenMPI's variables), end with the losses and the very weights of two torchrun nodes of 2 processes
    given the same arguments. On one host the local ranks are the global ones and every process is on
    node 0. Mutation: the node as RANK % LOCAL_WORLD_SIZE: nodes 1-3, and the places assertion fails."""
    (tmp_path / "mpi").mkdir()
    proc = run(mpi_command(mpirun, free_port(), *ARGS), timeout=300, cwd=tmp_path / "mpi", env=ROOT_OK)
    log = TrainLog(proc.stdout)
    log.assert_trained(world_size=4)
    places = {rank: (local, node) for rank, (_, _, local, _, node, _) in log.ranks.items()}
    assert places == {rank: (str(rank), "0") for rank in range(4)}, proc.stdout[-3000:]
    (tmp_path / "torchrun").mkdir()
    nodes = steps.command("multinode", ARGS, nproc=2, port=free_port(), root=REPO)
    codes, outs = zip(*run_together(nodes, timeout=300, cwd=tmp_path / "torchrun"), strict=True)
    assert codes == (0, 0), outs
    assert TrainLog(outs[0]).losses == log.losses
    torchrun = load_snapshot(tmp_path / "torchrun" / "multinode_snapshot.pt")
    mpi = load_snapshot(tmp_path / "mpi" / "multinode_snapshot.pt")
    for part in ("MODEL_STATE", "OPTIMIZER_STATE"):
        torch.testing.assert_close(mpi[part], torchrun[part], rtol=0, atol=0)


def test_the_wrapper_outside_mpirun_says_what_is_missing(tmp_path):
    """The wrapper outside mpirun or without MASTER_ADDR says what is missing."""
    alone = subprocess.run([WRAPPER, "x.py"], capture_output=True, text=True, check=False)
    assert alone.returncode == 2 and "start me with mpirun" in alone.stderr
    env = {**os.environ, "OMPI_COMM_WORLD_RANK": "0"}
    env.pop("MASTER_ADDR", None)
    no_addr = subprocess.run([WRAPPER, "x.py"], capture_output=True, text=True, check=False, env=env)
    assert no_addr.returncode != 0 and "set MASTER_ADDR" in no_addr.stderr


def test_a_refusal_under_mpirun_is_said_once_on_stderr(mpirun, tmp_path):
    """Under mpirun there is no torchrun summary to carry a refusal: local rank 0 prints it (once on this
    one host), the others end quietly, and nothing is written. Mutation: the print in the lesson's
    __main__ dropped: the run fails without a word, and the count is 0."""
    command = mpi_command(mpirun, free_port(), "0", "1")
    proc = run(command, timeout=120, check=False, cwd=tmp_path, env=ROOT_OK)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert proc.stdout.count("total_epochs must be positive and finite, got 0") == 1, proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout and not list(tmp_path.iterdir()), proc.stdout[-3000:]
