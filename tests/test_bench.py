"""The benchmark harness in a tiny configuration: the report's structure, both plots, agreeing losses."""

import json

import pytest
from conftest import PYTHON, REPO, run

# spawn and two local nodes are left out for time: tests/test_examples.py covers those launchers
VARIANTS = ["plain", "ddp_ws1", "torchrun", "accelerate", "plain_accum", "tuned"]
RATIOS = ["ddp_ws1/plain", "accelerate/torchrun", "torchrun/plain", "tuned/plain_accum"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    tiny = ["--workloads", "tiny", "--repeats", "1", "--epochs", "2", "--tiny_size", "512"]
    proc = run(
        [PYTHON, REPO / "tools" / "bench.py", "--out", out, *tiny, "--variants", *VARIANTS], timeout=600
    )
    return out, proc.stdout, json.loads((out / "bench.json").read_text())


def test_report_has_every_variant_and_ratio(bench):
    _, _, report = bench
    assert {"machine", "settings", "summary", "runs"} <= set(report)
    assert {"cpu", "cores", "torch", "accelerate", "backend", "commit"} <= set(report["machine"])
    part = report["summary"]["tiny"]
    assert list(part["variants"]) == VARIANTS
    for row in part["variants"].values():
        assert {"mean", "std", "min", "max", "n", "step_ms", "ranks", "final_loss"} <= set(row)
        assert row["mean"] > 0 and row["n"] == 1
    assert set(RATIOS) <= set(part["ratios"])
    assert "max_abs_loss_diff" in part["ratios"]["accelerate/torchrun"]
    # throughput leaves out the warm-up epoch
    run_ = report["runs"][0]
    last = run_["epochs"][-1]
    assert run_["samples_per_s"] == pytest.approx(last["samples_per_s"])


def test_table_is_printed(bench):
    _, stdout, _ = bench
    assert "tiny: global batch 64" in stdout and "samples/s (mean ± std)" in stdout
    for name in [*VARIANTS, *RATIOS]:
        assert f"  {name} " in stdout, name


def test_plots_are_written(bench):
    out, _, _ = bench
    for name in ("loss.png", "throughput.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000, name


def test_loss_curves_of_all_variants_agree(bench):
    _, _, report = bench
    runs = {r["variant"]: r["losses"] for r in report["runs"]}
    for name in ["ddp_ws1", "torchrun", "accelerate"]:
        assert runs[name] == pytest.approx(runs["plain"], rel=1e-4), name
    # the tuned variant sends fp16 gradients: close to one process with the same accumulation, not equal
    assert runs["tuned"] == pytest.approx(runs["plain_accum"], rel=1e-2)
    assert report["summary"]["tiny"]["ratios"]["accelerate/torchrun"]["max_abs_loss_diff"] < 1e-5
