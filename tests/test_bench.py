"""The benchmark harness in a tiny configuration: every variant and ratio reported, plots, agreeing losses.

Budget: one bench run of 7 short trainings, about 3.5 minutes of CPU time; 4.5 to 7 minutes of wall time
measured on 2 cores shared at load average 7 to 9.
"""

import json

import pytest
from conftest import PYTHON, REPO, run

VARIANTS = ["plain", "tutorial", "tutorial_mse", "ddp_ws1", "spawn", "torchrun", "accelerate", "two_nodes"]
RATIOS = [
    "plain/tutorial",
    "plain/tutorial_mse",
    "ddp_ws1/plain",
    "accelerate/torchrun",
    "torchrun/plain",
    "two_nodes/torchrun",
]
RATIOS += ["spawn/torchrun"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    tiny = ["--workloads", "tiny", "--repeats", "1", "--epochs", "2", "--tiny_size", "256"]
    proc = run([PYTHON, REPO / "tools" / "bench.py", "--out", out, *tiny], timeout=600)
    return out, proc.stdout, json.loads((out / "bench.json").read_text())


def test_report_has_every_variant_and_ratio(bench):
    out, stdout, report = bench
    assert {"machine", "settings", "summary", "runs"} <= set(report)
    assert {"cpu", "cores", "torch", "accelerate", "backend", "commit"} <= set(report["machine"])
    assert report["settings"]["global_batch"] == 32  # the tutorial's batch
    part = report["summary"]["tiny"]
    assert list(part["variants"]) == VARIANTS
    for row in part["variants"].values():
        assert {"mean", "std", "min", "max", "n", "step_ms", "ranks", "final_loss"} <= set(row)
        assert row["mean"] > 0 and row["n"] == 1
    assert list(part["ratios"]) == RATIOS
    # throughput leaves out the warm-up epoch
    first = report["runs"][0]
    assert first["samples_per_s"] == pytest.approx(first["epochs"][-1]["samples_per_s"])
    # the same tables printed and written, every variant and ratio a row
    table = (out / "table.md").read_text()
    assert table in stdout
    for name in VARIANTS + RATIOS:
        assert f"\n| {name} | " in table, name
    assert "| plain/tutorial | " in stdout


def test_plots_are_written(bench):
    out, _, _ = bench
    for name in ("loss.png", "throughput.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000, name


def test_loss_curves_agree(bench):
    """The same seed, data and global batch: every launcher takes the same steps as one process."""
    _, _, report = bench
    runs = {r["variant"]: r["losses"] for r in report["runs"]}
    assert len(runs["plain"]) == 2
    for name in ["ddp_ws1", "spawn", "torchrun", "accelerate", "two_nodes"]:
        assert runs[name] == pytest.approx(runs["plain"], rel=1e-4), name
    # the tutorial trains on data of its own: not compared
    assert set(report["summary"]["tiny"]["max_abs_loss_diff_vs_plain"]) == set(VARIANTS) - {
        "plain",
        "tutorial",
        "tutorial_mse",
    }
