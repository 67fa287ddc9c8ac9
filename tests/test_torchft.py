"""examples/multigpu_torchft.py: replica groups that train as one through a torchft lighthouse"""

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import EXAMPLES, REPO, free_port, run

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
LESSON = str(EXAMPLES / "multigpu_torchft.py")
ENV = {**os.environ, "RUST_LOG": "warn", "CUDA_VISIBLE_DEVICES": ""}


def lesson(tmp_path, *args, timeout=60):
    command = [TORCHRUN, "--standalone", "--nproc-per-node=1", LESSON, *args]
    return run(command, timeout=timeout, check=False, env=ENV, cwd=tmp_path)


def test_two_groups_train_as_one_and_end_identical(tmp_path):
    """make torchft: a lighthouse and two groups; both log every epoch with 2 groups at the end, identical"""
    summary = tmp_path / "summary.json"
    command = [sys.executable, str(REPO / "tools" / "torchft_demo.py"), "--dir", str(tmp_path / "runs")]
    result = run([*command, "--epochs", "4", "--summary", str(summary)], timeout=240, check=False, env=ENV)
    assert result.returncode == 0, result.stdout[-3000:]
    account = json.loads(summary.read_text())
    for name in ("group0", "group1"):
        [start] = account[name]
        assert start["returncode"] == 0
        assert start["epochs"][-1] == [4, 2], start  # the last epoch, trained by both groups
        epochs = [epoch for epoch, _ in start["epochs"]]
        assert epochs == sorted(set(epochs)), epochs  # a group's epochs never go back
    assert account["identical"] == ["weights identical on 2 of 2 groups"]
    for group in ("group0", "group1"):  # each group saved its own snapshot, as on its own node
        assert (tmp_path / "runs" / group / "multigpu_torchft_snapshot.pt").is_file()


def test_no_lighthouse_is_a_bounded_wait_that_names_the_address(tmp_path):
    address = f"http://127.0.0.1:{free_port()}"
    result = lesson(tmp_path, "2", "1", "--timeout", "3", "--lighthouse", address)
    assert result.returncode != 0
    assert f"no quorum of 1 at {address}: 3 s" in result.stdout
    assert not list(tmp_path.glob("*.pt"))  # nothing trained, nothing written


def test_fewer_groups_than_min_replicas_is_a_bounded_wait_that_names_the_count(tmp_path):
    port = free_port()
    house = [str(Path(sys.executable).with_name("torchft_lighthouse")), "--min_replicas", "2"]

    lighthouse = subprocess.Popen([*house, "--bind", f"127.0.0.1:{port}"], env=ENV, stdout=subprocess.DEVNULL)
    try:
        args = ["2", "1", "--timeout", "3", "--min_replicas", "2", "--lighthouse", f"http://127.0.0.1:{port}"]
        result = lesson(tmp_path, *args)
    finally:
        lighthouse.kill()
        lighthouse.wait(10)
    assert result.returncode != 0
    assert f"no quorum of 2 at http://127.0.0.1:{port}: 3 s" in result.stdout


def test_bad_arguments_exit_2_before_anything_starts(tmp_path):
    result = lesson(tmp_path, "2", "1", "--replica_group", "2", "--replica_groups", "2")
    assert result.returncode != 0
    assert "needs 0 <= --replica_group < --replica_groups" in result.stdout
    command = [TORCHRUN, "--standalone", "--nproc-per-node=2", LESSON, "2", "1"]
    result = run(command, timeout=60, check=False, env=ENV, cwd=tmp_path)
    assert "a group is one process" in result.stdout
    result = run([sys.executable, LESSON, "2", "1"], timeout=60, check=False, env=ENV, cwd=tmp_path)
    assert result.returncode == 2 and "a group is one process" in result.stdout
