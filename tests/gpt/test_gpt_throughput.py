"""The GPT throughput benchmark, benchmarks/gpt_throughput.py (both variants and their ratio, every
--parallel strategy against ddp at the same global batch, nanoGPT's loop, an unknown strategy refused),
and the table the GPU check makes of its runs. Tiny model, a few steps each."""

import argparse
import json
import re
import sys
import types

import pytest
import torch
from gpt_helpers import BENCH_FORKED, BENCH_GPT, run, train
from helpers import PYTHON, REPO, import_gpt_module


def test_gpu_checks_table_names_the_fastest_run_that_fits_40_gb(tmp_path, cache):
    """harness/gpu_table.py (make gpu-check's table) on a real run's metrics, steps 6 to 10, and on a copy
    made 10 times as fast at 50 GB of peak memory: a row each with its numbers and command, and the real
    run named the fastest under 40 GB. Mutation: the 40 GB bound dropped -> the copy is named: this fails."""
    args = ["--max_steps", 10, "--sample_chars", 0, "--peak_tflops", 1, "--metrics_path", "small.jsonl"]
    train(tmp_path, cache, *args)
    records = [json.loads(line) for line in (tmp_path / "small.jsonl").read_text().splitlines()]
    (step10,) = [dict(r) for r in records if r.get("step_ms") and r["step"] == 10]  # kept as logged
    for r in records:
        if "step_ms" in r:
            r.update(step_ms=r["step_ms"] / 10, tokens_per_s=r["tokens_per_s"] * 10)
        if "memory" in r:
            r["memory"]["peak_bytes"] = 50e9
    (tmp_path / "large.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for name in ("small", "large"):
        (tmp_path / f"{name}.cmd").write_text(f"train.py --run {name}")
    proc = run([PYTHON, REPO / "harness" / "gpu_table.py", tmp_path, "small", "large"], timeout=60)
    row = f"| small | {step10['step_ms']:.1f} | {step10['tokens_per_s']:,.0f} | "
    assert row in proc.stdout and "`train.py --run small` |" in proc.stdout, proc.stdout
    assert f"| {100 * step10['mfu']:.1f}% | {100 * step10['mfu_llmc']:.1f}% |" in proc.stdout, proc.stdout
    assert "| large | " in proc.stdout and "| 47,684 | " in proc.stdout, proc.stdout  # 50e9 bytes in MiB
    assert "fastest under 40 GB of peak memory: small," in proc.stdout, proc.stdout


# ---- benchmark --------------------------------------------------------------------------------------
def test_the_benchmark_runs_both_variants_and_prints_their_ratio(tmp_path, cache):
    """Under torchrun, as users run it."""
    cmd = [PYTHON, BENCH_GPT, "--rounds", 1, "--steps", 6, "--log_every", 3]
    cmd += ["--global_batch", 8, "--cache_dir", cache, "--out", tmp_path / "gpt.json", "--"]
    cmd += ["--n_layer", 1, "--n_head", 2, "--n_embd", 16, "--block_size", 16]
    proc = run(cmd, timeout=600)
    assert "one_process_2_threads" in proc.stdout and "ddp_2_processes_1_thread" in proc.stdout
    ratio = float(re.search(r"ratio ddp/one \(goal >= 0.95\) ([0-9.]+)", proc.stdout).group(1))
    report = json.loads((tmp_path / "gpt.json").read_text())
    assert report["ratio"] == pytest.approx(ratio, abs=1e-3) and ratio > 0


def test_the_benchmark_compares_every_strategy_with_ddp(tmp_path, cache):
    """The benchmark compares every strategy with DDP at the same global batch.

    One launch per strategy, forked (BENCH_FORKED)."""
    choices = next(
        a for a in import_gpt_module("config").get_parser()._actions if a.dest == "parallel"
    ).choices
    cmd = [PYTHON, BENCH_GPT, "--strategies", "--rounds", 1, "--steps", 4, *BENCH_FORKED]
    cmd += ["--log_every", 2, "--global_batch", 8, "--cache_dir", cache, "--out", tmp_path / "s.json", "--"]
    cmd += ["--n_layer", 2, "--n_head", 2, "--n_embd", 16, "--block_size", 16]
    proc = run(cmd, timeout=600)  # a strategy at another global batch would end it with an error
    report = json.loads((tmp_path / "s.json").read_text())
    assert not report["failed"], report["failed"]
    assert list(report["tokens_per_s"]) == list(choices) and all(report["tokens_per_s"].values())
    assert "on 2 CPU cores these show overheads, not speedups" in proc.stdout
    for name in choices:
        if name != "ddp":
            ratio = float(re.search(rf"^  {name}/ddp ([0-9.]+)$", proc.stdout, re.M).group(1))
            assert report["ratio_to_ddp"][name] == pytest.approx(ratio, abs=1e-3)


def test_the_benchmark_compares_the_trainer_with_nanogpts_loop(tmp_path, cache):
    """--nanogpt (make bench-anchors): nanoGPT's loop, benchmarks/nanogpt_loop.py, and train.py on one folder
    of nanoGPT's character data, the cpu preset's shape, 2 processes each (forked, BENCH_FORKED): nanoGPT
    and the trainer in float32, and in bf16 where the CPU has it in hardware, train at the same global
    batch (the benchmark checks train.py's), and each ratio of the trainer's tokens/s to nanoGPT's is
    printed with its rounds and written; where the CPU emulates bf16 (model.cpu_emulates), a line says
    why that run is left out. Mutations: nanogpt_loop.py's line printed as "iteration N: ..." -> its run
    counts as failed and the benchmark exits 1; bf16 run where emulated -> its row is there."""
    cmd = [PYTHON, BENCH_GPT, "--nanogpt", "--rounds", 1, "--steps", 4, "--log_every", 2, *BENCH_FORKED]
    cmd += ["--global_batch", 4, "--cache_dir", cache, "--out", tmp_path / "n.json"]
    proc = run(cmd, timeout=600)
    report = json.loads((tmp_path / "n.json").read_text())
    emulated = import_gpt_module("model").cpu_emulates(torch.bfloat16)
    runs = ["nanogpt", "trainer"] if emulated else ["nanogpt", "trainer", "trainer_bf16"]
    assert list(report["tokens_per_s"]) == runs, report
    assert all(len(v) == 1 and v[0] > 0 for v in report["tokens_per_s"].values()), report
    ratio = float(re.search(r"ratio trainer/nanogpt \(float32 both\) ([0-9.]+); ", proc.stdout).group(1))
    assert report["ratio"] == pytest.approx(ratio, abs=1e-3) and "over 1 rounds" in proc.stdout
    if emulated:
        assert proc.stdout.startswith("trainer_bf16 left out: this CPU emulates bf16 (no AMX"), proc.stdout
        assert "ratio trainer_bf16/nanogpt: not run, this CPU emulates bf16" in proc.stdout
        assert report["ratio_bf16"] is None
        return
    bf16 = float(re.search(r"ratio trainer_bf16/nanogpt \(goal >= 1.05\) ([0-9.]+); ", proc.stdout).group(1))
    assert report["ratio_bf16"] == pytest.approx(bf16, abs=1e-3)


def test_the_nanogpt_comparison_leaves_bf16_out_only_where_the_cpu_emulates_it(tmp_path, monkeypatch, capsys):
    """--nanogpt's plan and report in process, on both kinds of CPU (model.cpu_emulates answering either
    way), which the run above meets one of: with bf16 in hardware the trainer's bf16 run is planned and its
    ratio printed and written; where bf16 is emulated that run is left out, a line says why at the start
    and among the ratios, and ratio_bf16 is null. Mutations: the test of cpu_emulates dropped -> a bf16
    run planned where emulated; the report without its not-run line -> fails here."""
    import gpt_throughput as bench  # benchmarks/gpt_throughput.py

    args = argparse.Namespace(nanogpt=True, shards=False, metrics=False, strategies=None, global_batch=32)
    args.__dict__.update(rounds=1, steps=40, out=str(tmp_path / "n.json"))
    for emulated in (False, True):
        model = types.SimpleNamespace(cpu_emulates=lambda dtype, e=emulated: e and dtype == torch.bfloat16)
        monkeypatch.setitem(sys.modules, "model", model)  # what plan() imports it from
        variants, baseline = bench.plan(args, [], None)
        names = list(variants)
        results = {name: [100.0 * (1 + i / 10)] for i, name in enumerate(names)}
        bench.report(args, [], names, baseline, results, {})
        out, report = capsys.readouterr().out, json.loads((tmp_path / "n.json").read_text())
        assert "ratio trainer/nanogpt (float32 both) 1.100; " in out, out
        if emulated:
            assert names == ["nanogpt", "trainer"] and report["ratio_bf16"] is None, names
            assert out.startswith(f"trainer_bf16 left out: {bench.BF16_EMULATED}\n"), out
            assert f"  ratio trainer_bf16/nanogpt: not run, {bench.BF16_EMULATED}\n" in out, out
        else:
            assert (
                names == ["nanogpt", "trainer", "trainer_bf16"] and variants["trainer_bf16"][2][-1] == "bf16"
            )
            assert "ratio trainer_bf16/nanogpt (goal >= 1.05) 1.200; " in out, out
            assert report["ratio_bf16"] == pytest.approx(1.2)


def test_the_benchmark_refuses_an_unknown_strategy(tmp_path):
    proc = run([PYTHON, BENCH_GPT, "--strategies", "nope"], timeout=120, check=False)
    assert proc.returncode == 2
    assert "--strategies: unknown ['nope']; train.py's --parallel choices: ['ddp'" in proc.stdout
