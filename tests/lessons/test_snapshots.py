"""Snapshots survive crashes while writing, and a bad snapshot stops the run without being overwritten."""

import io
import os
import signal

import pytest
import torch
from helpers import SITES, example_cmd, load_snapshot, run


@pytest.fixture(scope="module")
def good_snapshot(tmp_path_factory):
    folder = tmp_path_factory.mktemp("good")
    cmd = example_cmd("single_gpu", 1, 1, "--dataset_size", 64, "--snapshot_path", "good.pt")
    run(cmd, timeout=300, cwd=folder)
    return (folder / "good.pt").read_bytes()


class RunsCodeOnLoad:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def bad_snapshots(good):
    real = torch.load(io.BytesIO(good), weights_only=True)
    other_model = {**real, "MODEL_STATE": {"weight": torch.zeros(5, 5), "bias": torch.zeros(5)}}
    yield "garbage", b"this is not a snapshot", "single_gpu"
    yield "truncated", good[: len(good) // 2], "single_gpu"
    yield "other model", other_model, "single_gpu"
    yield "other workload", good, "vision"
    yield "runs code", {"MODEL_STATE": RunsCodeOnLoad(), "EPOCHS_RUN": 1}, "single_gpu"


@pytest.mark.parametrize("case", ["garbage", "truncated", "other model", "other workload", "runs code"])
def test_a_bad_snapshot_stops_the_run_and_is_left_untouched(good_snapshot, tmp_path, case):
    _, content, workload = next(c for c in bad_snapshots(good_snapshot) if c[0] == case)
    path = tmp_path / "snap.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    before = path.read_bytes()
    args = [3, 1, "--snapshot_path", path, "--dataset_size", 64]
    # torch.load's own default would run the pickle's code under this variable: only weights_only=True, passed
    # by the example itself, refuses it (the shared snapshots block is the same in every example)
    env = {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
    cmd = example_cmd("single_gpu", *args, vision=workload == "vision")
    proc = run(cmd, timeout=300, check=False, cwd=tmp_path, env=env)
    assert proc.returncode != 0
    assert f"cannot resume from {path}" in proc.stdout and "Move it away" in proc.stdout, proc.stdout
    assert "epoch 1/" not in proc.stdout, "nothing trains from scratch"
    assert path.read_bytes() == before, "the snapshot is never overwritten"
    assert not (tmp_path / "pwned").exists(), "loading must not run code"


def test_an_unfit_snapshot_is_explained_once_last_under_mp_spawn(good_snapshot, tmp_path):
    """A snapshot that does not fit is explained once whole and last under mp.spawn.

    A tiny run's snapshot given to the vision workload: one process says why, with the keys themselves
    (not a first line cut short), and mp.spawn adds no traceback after it."""
    path = tmp_path / "snap.pt"
    path.write_bytes(good_snapshot)
    args = [3, 1, "--snapshot_path", path, "--dataset_size", 16, "--nproc", 2]
    proc = run(example_cmd("multigpu", *args, vision=True), timeout=300, check=False, cwd=tmp_path)
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:]
    assert out.count(f"error: cannot resume from {path}: RuntimeError(") == 1, out[-3000:]
    assert 'Missing key(s) in state_dict: "conv1.weight"' in out, out[-3000:]
    assert 'Unexpected key(s) in state_dict: "weight", "bias". \'). Move it away to start again.' in out
    assert "Traceback" not in out and "ProcessExitedException" not in out, out[-3000:]
    assert path.read_bytes() == good_snapshot


@pytest.mark.parametrize("lesson", ["multigpu_torchrun", "multigpu_accelerate"])
def test_under_torchrun_an_unfit_snapshot_is_said_once_last(good_snapshot, tmp_path, lesson):
    """Under torchrun a snapshot that does not fit is said once as its summary's error.

    The same misfit under torchrun: not printed by a process, but shown once, whole, as the error of
    torchrun's closing summary (rank 0's error file); the other process ends quietly, nothing is written."""
    path = tmp_path / "snap.pt"
    path.write_bytes(good_snapshot)
    args = [3, 1, "--snapshot_path", path, "--dataset_size", 16]
    proc = run(example_cmd(lesson, *args, nproc=2, vision=True), timeout=300, check=False, cwd=tmp_path)
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:]
    assert out.count(f"cannot resume from {path}") == 1, out[-3000:]
    said = f"  argparse.ArgumentError: error: cannot resume from {path}: RuntimeError('Error(s) in loading"
    assert said in out, out[-3000:]
    assert 'Missing key(s) in state_dict: "conv1.weight"' in out, out[-3000:]
    assert "exitcode  : 2" in out and "epoch 1/" not in out, out[-3000:]
    assert path.read_bytes() == good_snapshot and sorted(os.listdir(tmp_path)) == ["snap.pt"]


@pytest.mark.parametrize("how", ["error", "kill"])
def test_a_write_cut_short_keeps_the_previous_snapshot(tmp_path, how):
    env = {"PYTHONPATH": str(SITES / "half_a_save"), "HOW": how}
    cmd = example_cmd("single_gpu", 2, 1, "--dataset_size", 64, "--snapshot_path", "snap.pt")
    proc = run(cmd, timeout=300, check=False, cwd=tmp_path, env=env)
    assert proc.returncode == (-signal.SIGKILL if how == "kill" else 1), proc.stdout[-3000:]
    assert load_snapshot(tmp_path / "snap.pt")["EPOCHS_RUN"] == 1, "the first epoch's snapshot is whole"
    leftovers = [p.name for p in tmp_path.iterdir() if p.name not in ("site", "snap.pt")]
    assert all(name.startswith("snap.pt.tmp.") for name in leftovers), leftovers  # never the snapshot
    resumed = run(cmd, timeout=300, cwd=tmp_path)
    assert "resuming from snap.pt: 1 epochs already run" in resumed.stdout
    assert load_snapshot(tmp_path / "snap.pt")["EPOCHS_RUN"] == 2
