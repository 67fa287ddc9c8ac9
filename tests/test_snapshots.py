"""Snapshots survive crashes while writing, and a bad snapshot stops the run without being overwritten."""

import importlib.util
import io
import os
import signal
import subprocess

import pytest
import torch
from conftest import EXAMPLES, PYTHON, example_cmd, load_snapshot, run


def load_example(name="single_gpu"):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    if workload == "vision":
        args += ["--workload", "vision", "--image_size", 8]
    proc = run(example_cmd("single_gpu", *args), timeout=300, check=False, cwd=tmp_path)
    assert proc.returncode != 0
    assert f"cannot resume from snapshot {path}" in proc.stdout and "move it away" in proc.stdout, proc.stdout
    assert "epoch 1/" not in proc.stdout, "nothing trains from scratch"
    assert path.read_bytes() == before, "the snapshot is never overwritten"
    assert not (tmp_path / "pwned").exists(), "loading must not run code"


def test_a_failure_in_the_middle_of_a_write_keeps_the_previous_snapshot(tmp_path, monkeypatch):
    example = load_example()
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "snap.pt"
    example.save_snapshot(path, model, optimizer, 1, "tiny")

    def half_a_save(obj, f):
        f.write(b"PK\x03\x04 half a zip file")
        raise OSError("disk full")

    monkeypatch.setattr(example.torch, "save", half_a_save)
    with pytest.raises(OSError, match="disk full"):
        example.save_snapshot(path, model, optimizer, 2, "tiny")
    monkeypatch.undo()
    assert example.load_snapshot(path, model, optimizer, "cpu", "tiny") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap.pt"], "no temporary file is left behind"


WRITER = """
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("ex", sys.argv[1]); ex = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ex)
model = torch.nn.Linear(2000, 2000)  # 16 MB per save, so a kill lands mid-write now and then
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for epochs_run in range(1, 1000):
    ex.save_snapshot(sys.argv[2], model, optimizer, epochs_run, "tiny")
    print(epochs_run, flush=True)
"""


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.11])
def test_killing_the_writer_at_any_moment_leaves_a_loadable_snapshot(tmp_path, delay):
    path = tmp_path / "snap.pt"
    writer = subprocess.Popen(
        [PYTHON, "-c", WRITER, EXAMPLES / "single_gpu.py", path], stdout=subprocess.PIPE, text=True
    )
    try:
        for _ in range(3):  # let a few saves complete, then kill it in the middle of the next ones
            assert writer.stdout.readline(), "the writer died early"
        if delay:
            subprocess.run(["sleep", str(delay)], check=True)
        writer.send_signal(signal.SIGKILL)
    finally:
        writer.kill()
        writer.wait(timeout=60)
    assert writer.returncode == -signal.SIGKILL
    assert load_snapshot(path)["EPOCHS_RUN"] >= 3
