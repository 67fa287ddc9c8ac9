"""examples/pitfalls: each script, run as it is, fails within its bound and names its cause in its last
line; with --fixed it succeeds (batchnorm_stats's fix, SyncBatchNorm, needs 2 GPUs: here it says so, and
tests/repo/test_gpu.py runs it). One pass of demos/pitfalls.py (what `make pitfalls` runs) checks them all."""

import json
import subprocess

import pytest
from helpers import PYTHON, REPO, SPAWN_BY_FORK, run

# pytest-timeout's bound above the report's own 1200 s (the first test to use the report runs it)
pytestmark = [pytest.mark.demo, pytest.mark.timeout(1260)]

# pitfall -> what its last line must name, and what its broken run must have shown
EXPECTED = {
    "uneven_inputs": ("uneven inputs", "Timed out"),
    "rank0_alone": ("rank 0 is outside any collective", "waiting for send/recv from rank 0"),
    "mismatched_collectives": (
        "mismatched collectives: rank 1 calls broadcast #1",
        "collective #1 of default_pg: entered by rank 0 (all_reduce), rank 1 (broadcast)",
    ),
    "unused_parameters": ("unused parameters", "Expected to have finished reduction"),
    "no_set_epoch": ("no set_epoch", "epoch 0, rank 0 of 2 gets samples"),
    "padded_validation": ("padded validation", "on 2 ranks, one process"),
    "wrong_interface": ("wrong interface", "Unable to find address for: eth9"),
    "port_in_use": ("port in use", "EADDRINUSE"),
    "node_local_snapshots": ("node-local snapshots", "the nodes found different snapshots"),
    "batchnorm_stats": ("per-process BatchNorm", "eval outputs by"),
    "rank0_eval_ddp": ("rank 0 evaluating through DDP", "entered by rank 0 (broadcast); not by rank 1"),
    "accumulation_sync": ("accumulation all-reduces every micro-batch", "12 all-reduces in 3 steps"),
}
# fixes that need what the suite's CPU runs do not have: what their --fixed run must say instead
NEEDS_GPUS = {"batchnorm_stats": "error: --fixed needs 2 GPUs: torch runs SyncBatchNorm on CUDA only"}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("pitfalls") / "report.json"
    # the ranks mp.spawn starts are forked (tests/programs/sites/spawn_by_fork): 4 CPU-s less a run
    cmd = [PYTHON, REPO / "demos" / "pitfalls.py", "--json", out]
    proc = run(cmd, timeout=1200, check=False, env=SPAWN_BY_FORK)
    return proc, {r["name"]: r for r in json.loads(out.read_text())}


def test_every_script_is_covered_and_short():
    scripts = sorted((REPO / "examples" / "pitfalls").glob("*.py"))
    assert sorted(s.stem for s in scripts) == sorted(EXPECTED)
    for script in scripts:
        assert len(script.read_text().splitlines()) <= 90, script.name


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_broken_fails_in_bound_naming_its_cause_and_fixed_succeeds(report, name):
    """Over a minute for the first: the report it reads runs every pitfall broken, then fixed (24 launches,
    3.5 min in a whole run), as make pitfalls does; the others read the same report."""
    proc, results = report
    result, (cause, seen) = results[name], EXPECTED[name]
    broken, fixed = result["broken"], result["fixed"]
    # within its bound: None is a run demos/pitfalls.py killed, still running at its 120 s
    assert broken["code"] not in (0, None), broken
    assert broken["lines"][-1].startswith(f"cause: {cause}"), broken["lines"][-5:]
    assert any(seen in line for line in broken["lines"]), broken["lines"][-10:]
    shown = proc.stdout.split(f"{name} ", 1)[1].splitlines()[0]
    assert proc.stdout.startswith("Each pitfall runs broken") and "| reproduced in " in shown, shown
    if name in NEEDS_GPUS:
        assert fixed["code"] == 2 and fixed["lines"][-1].endswith(NEEDS_GPUS[name]), fixed["lines"][-5:]
        assert "fixed: needs GPUs" in shown, shown
        return
    assert fixed["code"] == 0, fixed["lines"][-10:]
    assert "fixed: yes" in shown, shown


def test_make_pitfalls_refuses_an_unknown_name():
    proc = subprocess.run([PYTHON, REPO / "demos" / "pitfalls.py", "nosuch"], capture_output=True, text=True)
    assert proc.returncode == 2 and "no such pitfall: nosuch" in proc.stderr
