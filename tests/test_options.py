"""The performance options: accumulation keeps DDP equal to one process, the DDP options train correctly."""

import math

import pytest
import torch
from conftest import TrainLog, example_cmd, load_snapshot, run

# tiny regression, 3 epochs; every case below takes optimizer steps over 64 samples
COMMON = [3, 3, "--seed", "3", "--snapshot_path", "snapshot.pt"]
EXACT = {"rtol": 1e-5, "atol": 1e-6}
HALF = {"rtol": 2e-2, "atol": 2e-3}  # gradients rounded to 16 bits on the way through the all-reduce

CASES = [
    # name, per-process batch, options, how close to one process with batch 64
    ("single_gpu", 32, ["--grad_accum", "2"], EXACT),
    ("single_gpu", 16, ["--grad_accum", "4"], EXACT),
    ("multigpu_torchrun", 16, ["--grad_accum", "2"], EXACT),
    ("multigpu_accelerate", 16, ["--grad_accum", "2"], EXACT),
    ("multigpu", 32, ["--static_graph", "--bucket_cap_mb", "0.001", "--gradient_as_bucket_view"], EXACT),
    ("multigpu_torchrun", 32, ["--comm_hook", "fp16"], HALF),
    ("multigpu_accelerate", 16, ["--grad_accum", "2", "--comm_hook", "bf16", "--bucket_cap_mb", "1"], HALF),
    ("multinode", 8, ["--grad_accum", "4", "--comm_hook", "fp16", "--gradient_as_bucket_view"], HALF),
]


def train(name, batch, options, folder):
    cmd = example_cmd(name, *COMMON, "--batch_size", batch, *options)
    log = TrainLog(run(cmd, timeout=300, cwd=folder).stdout)
    return log, load_snapshot(folder / "snapshot.pt")["MODEL_STATE"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, batch 64, no options: what every case must reproduce."""
    return train("single_gpu", 64, [], tmp_path_factory.mktemp("reference"))


@pytest.mark.parametrize(("name", "batch", "options", "tolerance"), CASES, ids=lambda x: str(x))
def test_option_takes_the_same_steps_as_one_process(reference, tmp_path, name, batch, options, tolerance):
    log, weights = train(name, batch, options, tmp_path)
    log.assert_trained(1 if name == "single_gpu" else 2, factor=10)
    for key, tensor in reference[1].items():
        torch.testing.assert_close(weights[key], tensor, **tolerance)
    assert log.losses == pytest.approx(reference[0].losses, rel=tolerance["rtol"])


def test_bf16_autocast_and_channels_last_train_the_vision_model(tmp_path):
    vision = ["--workload", "vision", "--image_size", "16", "--batch_size", "8", "--dataset_size", "64"]
    cmd = example_cmd("multigpu_torchrun", 2, 2, *vision, "--bf16", "--channels_last", "--grad_accum", "2")
    log = TrainLog(run(cmd, timeout=300, cwd=tmp_path).stdout)
    assert log.epochs == [1, 2] and log.ranks_in_sync == 2
    assert all(math.isfinite(loss) for loss in log.losses)
