"""The examples train, agree with each other, resume exactly and run from a lone copy."""

import json
import shutil

import pytest
import torch
from conftest import EXAMPLES, REPO, VENV, TrainLog, example_cmd, load_snapshot, run

# Per-process batch size and world size of the DDP runs; single_gpu gets their product as its batch.
BATCH, NPROC = 32, 2
EPOCHS = 4
COMMON = ["--seed", "3", "--metrics_path", "metrics.jsonl"]
DDP_EXAMPLES = ["multigpu", "multigpu_torchrun", "multigpu_accelerate"]


class Run:
    def __init__(self, name, folder, proc):
        self.folder = folder
        self.log = TrainLog(proc.stdout)
        self.snapshot = folder / f"{name}_snapshot.pt"
        self.metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each example trained once, from a copy alone in an empty folder (so nothing else can be imported)."""
    results = {}
    for name in ["single_gpu", *DDP_EXAMPLES]:
        folder = tmp_path_factory.mktemp(name)
        script = shutil.copy(EXAMPLES / f"{name}.py", folder)
        batch = BATCH * NPROC if name == "single_gpu" else BATCH
        args = [EPOCHS, 2, "--batch_size", batch, *COMMON]
        proc = run(example_cmd(name, *args, nproc=NPROC, script=script), timeout=300, cwd=folder)
        results[name] = Run(name, folder, proc)
    return results


@pytest.mark.parametrize("name", ["single_gpu", *DDP_EXAMPLES])
def test_trains_from_a_lone_copy(runs, name):
    result = runs[name]
    world_size = 1 if name == "single_gpu" else NPROC
    result.log.assert_trained(world_size, factor=10)
    assert result.log.epochs == list(range(1, EPOCHS + 1))
    assert result.log.backend == (None if name == "single_gpu" else "gloo")  # no GPU visible: gloo
    # Only what the run was asked to write: no stray temporary snapshot files.
    written = sorted(p.name for p in result.folder.iterdir())
    assert written == sorted([f"{name}.py", "metrics.jsonl", f"{name}_snapshot.pt"])


@pytest.mark.parametrize("name", ["single_gpu", *DDP_EXAMPLES])
def test_metrics_and_snapshot_contract(runs, name):
    result = runs[name]
    world_size = 1 if name == "single_gpu" else NPROC
    assert [m["epoch"] for m in result.metrics] == list(range(1, EPOCHS + 1))
    for record, printed in zip(result.metrics, result.log.losses, strict=True):
        assert record["world_size"] == world_size
        assert record["samples_per_s"] > 0
        assert record["loss"] == pytest.approx(printed, rel=1e-5)
    snapshot = load_snapshot(result.snapshot)
    assert snapshot["EPOCHS_RUN"] == EPOCHS
    assert set(snapshot["MODEL_STATE"]) == {"weight", "bias"}  # the unwrapped model: no "module." prefix
    assert snapshot["OPTIMIZER_STATE"]["state"], "optimizer state (momentum) is saved"


@pytest.mark.parametrize("name", DDP_EXAMPLES)
def test_ddp_equals_single_process_with_the_global_batch(runs, name):
    """N processes with batch b take the same steps as one process with batch N*b."""
    expected = load_snapshot(runs["single_gpu"].snapshot)["MODEL_STATE"]
    actual = load_snapshot(runs[name].snapshot)["MODEL_STATE"]
    for key, tensor in expected.items():
        torch.testing.assert_close(actual[key], tensor, rtol=1e-5, atol=1e-6)
    assert runs[name].log.losses == pytest.approx(runs["single_gpu"].log.losses, rel=1e-4)


@pytest.mark.parametrize("name", ["single_gpu", "multigpu_torchrun", "multigpu_accelerate"])
def test_resume_ends_exactly_where_an_uninterrupted_run_ends(runs, tmp_path, name):
    args = ["--batch_size", BATCH * NPROC if name == "single_gpu" else BATCH, *COMMON]
    first = run(example_cmd(name, 2, 2, *args), timeout=300, cwd=tmp_path)
    assert TrainLog(first.stdout).epochs == [1, 2]
    second = run(example_cmd(name, EPOCHS, 2, *args), timeout=300, cwd=tmp_path)
    assert f"resuming from {name}_snapshot.pt at epoch 3" in second.stdout
    assert TrainLog(second.stdout).epochs == [3, 4], "the saved epoch is not run again"
    resumed = load_snapshot(tmp_path / f"{name}_snapshot.pt")
    uninterrupted = load_snapshot(runs[name].snapshot)
    for key, tensor in uninterrupted["MODEL_STATE"].items():
        assert torch.equal(resumed["MODEL_STATE"][key], tensor), key
    assert TrainLog(second.stdout).checksum == runs[name].log.checksum


def test_make_multinode_trains_on_two_local_nodes(tmp_path):
    make = ["make", "-C", REPO, "multinode", "EPOCHS=3", f"RUNS={tmp_path}", f"VENV={VENV}"]
    proc = run([*make, "ARGS=--dataset_size 512"], timeout=300)
    log = TrainLog(proc.stdout)
    log.assert_trained(world_size=4)
    assert (tmp_path / "multinode" / "snapshot.pt").exists()
