"""The vision workload: ResNet-18 on synthetic images."""

from conftest import TrainLog, example_cmd, load_snapshot, run

TINY = ["--workload", "vision", "--batch_size", "4", "--momentum", "0.9"]


def test_trains_on_synthetic_images(tmp_path):
    cmd = example_cmd("single_gpu", 3, 3, *TINY, "--dataset_size", "128")
    log = TrainLog(run(cmd, timeout=600, cwd=tmp_path).stdout)  # ResNet-18 on 32x32 images: 96 steps
    assert log.epochs == [1, 2, 3]
    # each class is a pattern plus noise, so there is something to learn and the loss falls
    assert log.losses[-1] < log.losses[0] / 2, log.losses
    assert load_snapshot(tmp_path / "single_gpu_snapshot.pt")["MODEL_STATE"]["fc.weight"].shape == (10, 512)
