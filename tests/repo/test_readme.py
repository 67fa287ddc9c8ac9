"""The commands the README shows work as written."""

import pytest
from helpers import EPOCH_RE, REPO, VENV, TrainLog, doc_block, free_port, run

pytestmark = pytest.mark.quick

MARKER = "<!-- tests/repo/test_readme.py runs every command in the next block"


@pytest.mark.timeout(960)  # above the script's own 900 s bound
def test_the_example_commands_work_verbatim(tmp_path):
    """The README's by-hand block runs as written, in order. Over a minute: six lessons of 10 epochs and
    a vision run, as a reader runs them (90 s in a whole run)."""
    # A scratch folder that looks like the repository root, so snapshots land there and not in the checkout.
    (tmp_path / "examples").symlink_to(REPO / "examples")
    (tmp_path / ".venv").symlink_to(VENV)
    script = tmp_path / "readme.sh"
    # verbatim but for the two-node rendezvous port: a free one, not the README's fixed 29400
    block = doc_block("README.md", MARKER)
    assert block.count("--rdzv-endpoint=localhost:29400 ") == 2, block
    block = block.replace("localhost:29400", f"localhost:{free_port()}")
    script.write_text("set -e\n" + block)
    proc = run(["bash", script], timeout=900, cwd=tmp_path)
    # rank 0's epoch lines, in the block's order: one process for 10 epochs, the three single-machine DDP
    # steps on 2 ranks, the two "nodes" on 4, then vision.py's 2 epochs on one process
    worlds = [int(epoch[3]) for epoch in EPOCH_RE.findall(proc.stdout)]
    assert worlds == [1] * 10 + [2] * 30 + [4] * 10 + [1] * 2, proc.stdout[-3000:]
    assert TrainLog(proc.stdout).num_hosts == 1  # both "nodes" on this machine
    made = {p.name for p in tmp_path.glob("*_snapshot.pt")} - {"vision_snapshot.pt"}
    assert made == {
        f"{n}_snapshot.pt"
        for n in ["single_gpu", "multigpu", "multigpu_torchrun", "multigpu_accelerate", "multinode"]
    }
