"""The vision workload: ResNet-18 on an ImageFolder tree the test writes, and on synthetic images."""

import math

from conftest import TrainLog, example_cmd, load_snapshot, run
from PIL import Image

TINY = ["--workload", "vision", "--batch_size", "4", "--momentum", "0.9"]
EPOCHS = 4  # of 2 steps each on the image folder (16 images, 2 processes of batch 4)


def write_image_folder(root, classes=("cat", "dog"), per_class=8):
    for index, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            colour = (40 + 150 * index, 10 * i, 200 - 150 * index)
            Image.new("RGB", (20, 24), colour).save(root / name / f"{i}.png")


def test_trains_on_an_image_folder_with_two_processes(tmp_path):
    write_image_folder(tmp_path / "data")
    cmd = example_cmd("multigpu_torchrun", EPOCHS, EPOCHS, *TINY, "--data_dir", tmp_path / "data")
    log = TrainLog(run(cmd, timeout=300, cwd=tmp_path).stdout)
    assert log.epochs == list(range(1, EPOCHS + 1)) and log.world_size == 2 and log.ranks_in_sync == 2
    # the classes differ in colour: the model learns them, the loss falls from about ln 2 well below it
    assert all(map(math.isfinite, log.losses)) and log.losses[-1] < log.losses[0] / 2, log.losses
    # two class folders, so a two-way classifier: the data really came from the folder
    snapshot = load_snapshot(tmp_path / "multigpu_torchrun_snapshot.pt")
    assert snapshot["MODEL_STATE"]["fc.weight"].shape == (2, 512)


def test_trains_on_synthetic_images(tmp_path):
    cmd = example_cmd("single_gpu", 3, 3, *TINY, "--dataset_size", "128")
    log = TrainLog(run(cmd, timeout=600, cwd=tmp_path).stdout)  # ResNet-18 on 32x32 images: 96 steps
    assert log.epochs == [1, 2, 3]
    # each class is a pattern plus noise, so there is something to learn and the loss falls
    assert log.losses[-1] < log.losses[0] / 2, log.losses
    assert load_snapshot(tmp_path / "single_gpu_snapshot.pt")["MODEL_STATE"]["fc.weight"].shape == (10, 512)
