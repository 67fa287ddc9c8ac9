"""Snapshots survive crashes while writing, and a bad snapshot stops the run without being overwritten."""

import importlib.util
import io
import os
import signal

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
    # torch.load's own default would run the pickle's code under this variable: only weights_only=True, passed
    # by the example itself, refuses it (the shared snapshots block is the same in every example)
    env = {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
    proc = run(example_cmd("single_gpu", *args), timeout=300, check=False, cwd=tmp_path, env=env)
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


KILLED_MID_WRITE = """
import importlib.util, os, signal, sys, torch
spec = importlib.util.spec_from_file_location("example", sys.argv[1])
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)
model = torch.nn.Linear(20, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
example.save_snapshot(sys.argv[2], model, optimizer, 1, "tiny")

def half_then_die(obj, f):
    f.write(b"PK\\x03\\x04 the first half of a zip file")
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)

example.torch.save = half_then_die
example.save_snapshot(sys.argv[2], model, optimizer, 2, "tiny")
"""


def test_a_process_killed_in_the_middle_of_a_write_leaves_the_previous_snapshot(tmp_path):
    path = tmp_path / "snap.pt"
    proc = run([PYTHON, "-c", KILLED_MID_WRITE, EXAMPLES / "single_gpu.py", path], timeout=120, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stdout
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "snap.pt"]
    assert len(leftovers) == 1 and leftovers[0].startswith("snap.pt.tmp."), "killed while writing"
    assert load_snapshot(path)["EPOCHS_RUN"] == 1
