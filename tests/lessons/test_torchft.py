"""examples/multigpu_torchft.py: replica groups that train as one through a torchft lighthouse"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import EXAMPLES, REPO, free_port, run

pytestmark = pytest.mark.demo

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
LESSON = str(EXAMPLES / "multigpu_torchft.py")
ENV = {**os.environ, "RUST_LOG": "warn", "CUDA_VISIBLE_DEVICES": ""}


def lesson(tmp_path, *args, timeout=60):
    command = [TORCHRUN, "--standalone", "--nproc-per-node=1", LESSON, *args]
    return run(command, timeout=timeout, check=False, env=ENV, cwd=tmp_path)


def demo(tmp_path, *args):
    """demos/torchft_groups.py (make torchft) with args; its exit status and its account (--summary)."""
    summary = tmp_path / "summary.json"
    command = [sys.executable, str(REPO / "demos" / "torchft_groups.py"), "--dir", str(tmp_path / "runs")]
    result = run([*command, *args, "--summary", str(summary)], timeout=300, check=False, env=ENV)
    assert summary.is_file(), result.stdout[-3000:]
    return result, json.loads(summary.read_text())


def test_a_killed_group_heals_from_its_live_peer_which_waits_for_it(tmp_path):
    """make torchft FT_ARGS="--kill --kill_joining": a lighthouse and two groups, each saving its own
    snapshot as on its own node. Group 1 SIGKILLed after epoch 2, started again at once
    and killed as group 0 serves it the state, then started again: group 0 waits for it (a quorum of both
    groups), never restarted, never training alone, each epoch once; group 1's last start reads no snapshot
    (none was written: the first is at epoch 5), takes the live state, and both end at the last epoch with
    identical weights. Waiting is what keeps this from racing on a busy machine: group 0 cannot finish
    before group 1 is back. Mutation: the lighthouse's quorum of one with --kill (as before): group 0 trains
    at world size 1, and the sizes assertion fails. Its first line says it starts afresh (issue 74: a target
    run again either resumes or says so)."""
    result, account = demo(tmp_path, "--kill", "--kill_joining", "--kill_epoch", "2", "--epochs", "12")
    assert result.returncode == 0, result.stdout[-3000:]
    [survivor] = account["group0"]  # one start: no restart
    assert survivor["returncode"] == 0 and survivor["resumed"] is None
    epochs = [epoch for epoch, _ in survivor["epochs"]]
    assert epochs == list(range(1, 13)), epochs  # each once, in order: never back, never again
    assert {size for _, size in survivor["epochs"]} == {2}, survivor["epochs"]  # it waited, never alone
    first, joining, healed = account["group1"]
    assert (first["returncode"], joining["returncode"], healed["returncode"]) == (-9, -9, 0)
    assert healed["resumed"] is None and healed["epochs"][0][0] >= 3  # the live state, not epoch 1
    assert healed["epochs"][-1] == [12, 2]
    assert account["identical"] == ["weights identical on 2 of 2 groups"]
    for group in ("group0", "group1"):  # each group saved its own snapshot, as on its own node
        assert (tmp_path / "runs" / group / "multigpu_torchft_snapshot.pt").is_file()
    assert any("took the live state at step" in figure for figure in account["figures"])
    # shown: every 10th epoch line and each change of world size; all of them in the account's JSON
    assert "[group0] epoch 10/12 " in result.stdout and "[group0] epoch 5/12 " not in result.stdout
    # the kills said as they happen, between the epoch lines around them
    assert result.stdout.count("[demo] SIGKILL to group1 and its processes, as when its node is lost") == 2
    # its first line says that a second `make torchft` starts afresh, not from the snapshots above
    assert result.stdout.startswith(f"[demo] {(tmp_path / 'runs').resolve()}: started afresh; "), (
        result.stdout[:300]
    )


def test_a_group_back_after_the_end_is_told_none_can_heal_it(tmp_path):
    """A group back after the others ended is told it had nobody to heal from.

    On a fast machine the others can finish before a restarted group joins them (on an H200 machine at
    --epochs 12): it then trains alone, and the account says why nothing healed instead of offering one
    group's weights check as the result. Here group 1 is started again only once group 0 has ended
    (--alone more than the epochs left: a quorum of one, so group 0 goes on without it)."""
    args = ["--kill", "--kill_epoch", "2", "--epochs", "20", "--alone", "1000"]
    result, account = demo(tmp_path, *args)
    assert result.returncode == 1, result.stdout[-3000:]
    [survivor] = account["group0"]
    assert survivor["returncode"] == 0 and survivor["epochs"][-1][0] == 20
    assert 1 in {size for _, size in survivor["epochs"]}  # --alone: a quorum of one goes on
    [figure] = [f for f in account["figures"] if "live state" in f]
    assert figure.startswith("group1 took no live state") and figure.endswith("raise --epochs"), figure


def test_a_restarted_lighthouse_stops_groups_that_then_resume(tmp_path):
    """A restarted lighthouse stops the groups which resume from their snapshots.

    make torchft FT_ARGS=--restart_lighthouse: the lighthouse killed after epoch 7 and started again;
    torchft 0.2.0's groups do not find the new one: each stops at its quorum timeout naming the lighthouse,
    and, started again, resumes from its epoch-5 snapshot (the one started later may then heal from the
    other); both end at the last epoch, identical."""
    args = ["--restart_lighthouse", "--kill_epoch", "7", "--epochs", "12", "--timeout", "5"]
    result, account = demo(tmp_path, *args)
    assert result.returncode == 0, result.stdout[-3000:]
    firsts = []
    for name in ("group0", "group1"):
        stopped, resumed = account[name]
        assert stopped["returncode"] != 0 and stopped["no_quorum"], stopped
        assert resumed["returncode"] == 0 and resumed["resumed"] == 5, resumed  # its snapshot: 5 epochs
        assert resumed["epochs"][-1] == [12, 2]
        firsts.append(resumed["epochs"][0][0])
    assert min(firsts) == 6  # epochs 6 and 7 trained again (the later group may heal from the first)
    assert account["identical"] == ["weights identical on 2 of 2 groups"]


def test_no_lighthouse_is_a_bounded_wait_that_names_the_address(tmp_path):
    address = f"http://127.0.0.1:{free_port()}"
    result = lesson(tmp_path, "2", "1", "--timeout", "3", "--lighthouse", address)
    assert result.returncode != 0
    assert f"no quorum of 1 at {address}: 3 s" in result.stdout
    assert not list(tmp_path.glob("*.pt"))  # nothing trained, nothing written


def test_fewer_groups_than_min_replicas_is_a_named_bounded_wait(tmp_path):
    """Fewer groups than --min_replicas is a bounded wait that names the count."""
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
