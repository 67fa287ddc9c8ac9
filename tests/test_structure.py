"""The examples are copies by design: their shared blocks stay identical and each step stays a small diff."""

import difflib
import re

import pytest
from conftest import EXAMPLES

BLOCK_RE = re.compile(r"^# ---- shared: (\w+) ----\n(.*?)^# ---- end shared ----$", re.M | re.S)
STEPS = ["single_gpu", "multigpu", "multigpu_torchrun", "multinode"]
ALL = [*STEPS, "multigpu_accelerate"]
# Changed lines (added + removed) allowed between a step and the one it builds on. The first DDP step
# carries most of the lesson; the others only change how processes are launched. README.md quotes these.
DIFF_BOUND = {
    # 175 for the lesson itself, plus 40 for DDP's own options (the ddp_options block, no_sync)
    ("single_gpu", "multigpu"): 215,
    ("multigpu", "multigpu_torchrun"): 105,
    ("multigpu_torchrun", "multinode"): 40,
    ("multigpu_torchrun", "multigpu_accelerate"): 80,
}


def blocks(name):
    return dict(BLOCK_RE.findall((EXAMPLES / f"{name}.py").read_text()))


def test_every_example_has_the_shared_blocks():
    for name in ALL:
        expected = {"arguments", "workloads", "speed", "snapshots"}
        if name != "single_gpu":
            expected |= {"distributed", "ddp_options"}
        assert set(blocks(name)) == expected, name


@pytest.mark.parametrize(
    "block", ["arguments", "workloads", "speed", "snapshots", "distributed", "ddp_options"]
)
def test_shared_blocks_are_identical(block):
    copies = {name: blocks(name)[block] for name in ALL if block in blocks(name)}
    reference_name, reference = next(iter(copies.items()))
    for name, text in copies.items():
        lines = reference.splitlines(True), text.splitlines(True)
        diff = "".join(difflib.unified_diff(*lines, reference_name, name))
        assert not diff, f"block '{block}' drifted; make every copy the same:\n{diff}"


@pytest.mark.parametrize(("before", "after"), DIFF_BOUND)
def test_each_step_is_a_small_diff(before, after):
    old = (EXAMPLES / f"{before}.py").read_text().splitlines()
    new = (EXAMPLES / f"{after}.py").read_text().splitlines()
    changed = [line for line in difflib.unified_diff(old, new, lineterm="", n=0) if line[:1] in "+-"]
    changed = [line for line in changed if not line.startswith(("+++", "---"))]
    assert len(changed) <= DIFF_BOUND[before, after], f"{before} -> {after}: {len(changed)} changed lines"


def test_no_example_imports_another_local_file():
    local = {p.stem for p in EXAMPLES.glob("*.py")}
    for name in ALL:
        imports = re.findall(r"^\s*(?:from|import) (\w+)", (EXAMPLES / f"{name}.py").read_text(), re.M)
        assert not local & set(imports), name
