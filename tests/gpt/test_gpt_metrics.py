"""What the GPT trainer shows of a run: TensorBoard scalars equal to its JSON lines (read back through
TensorBoard's own loader and over HTTP from a TensorBoard server), a slow process named with its host, and
a profiler trace per process with its collectives. One run of 2 processes, one of them slowed, serves
them all (about 30 s on 2 cores)."""

import json
import re

import pytest
from gpt_helpers import BENCH_FORKED, BENCH_GPT, run, train
from helpers import (
    PROGRAMS,
    PYTHON,
    REPO,
    free_port,
    import_gpt_module,
    kill_group,
    popen,
    wait_for_json,
)

TENSORBOARD = [PYTHON, "-m", "tensorboard.main"]
SLOW_MS = 60
ARGS = ["--max_steps", 12, "--log_every", 4, "--eval_every", 12, "--sample_chars", 0, "--batch_size", 4]
ARGS += ["--metrics_path", "run/m.jsonl", "--profile_steps", "5:6", "--profile_dir", "run/traces"]
BREAKDOWN = r"compute ([0-9.]+) ms, collectives ([0-9.]+) ms, of which ([0-9.]+) ms \((\d+)%\) overlapped"
BREAKDOWN += " compute"


@pytest.fixture(scope="module")
def slowed(tmp_path_factory, cache):
    cwd = tmp_path_factory.mktemp("slowed")
    proc = train(
        cwd, cache, *ARGS, nproc=2, script=PROGRAMS / "late_batches.py", env={"SLOW_MS": str(SLOW_MS)}
    )
    records = [json.loads(line) for line in (cwd / "run" / "m.jsonl").read_text().splitlines()]
    return cwd / "run", proc.stdout, records


def scalars_from_event_files(folder):
    """{tag: {step: value}}, as TensorBoard's loader reads the folder's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    return {tag: {s.step: s.value for s in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def expected_scalars(records):
    """{tag: {step: value}} that the JSON lines say the event files hold."""
    tags = import_gpt_module("observability.metrics").TAGS
    out = {}
    for record in records:
        for key, value in record.items():
            if key in tags:
                out.setdefault(tags[key], {})[record["step"]] = value
        for rank, ms in enumerate(record.get("rank_ms", [])):
            out.setdefault(f"ranks/data_forward_ms/rank{rank}", {})[record["step"]] = ms
        if "memory" in record:
            out.setdefault(f"memory/peak_bytes/rank{record['rank']}", {})[record["step"]] = record["memory"][
                "peak_bytes"
            ]
    return out


def assert_same(read, expected):
    for tag, points in expected.items():
        assert tag in read, f"no scalar {tag} in the event files: {sorted(read)}"
        assert read[tag].keys() == points.keys(), tag
        for step, value in points.items():  # event files keep 32-bit floats
            assert read[tag][step] == pytest.approx(value, rel=1e-6), (tag, step)


def test_tensorboards_loader_reads_the_numbers_of_the_json_lines(slowed):
    folder, _, records = slowed
    expected = expected_scalars(records)
    assert {"train/loss", "val/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s"} <= expected.keys()
    assert "ranks/data_forward_ms/rank1" in expected and "memory/peak_bytes/rank1" in expected
    assert_same(scalars_from_event_files(folder), expected)


def test_a_tensorboard_server_serves_the_runs_scalars(slowed):
    folder, _, records = slowed
    port = free_port()
    cmd = [*TENSORBOARD, "--logdir", folder, "--host", "127.0.0.1", "--port", port, "--load_fast", "false"]
    with open(folder.parent / "tensorboard.log", "w") as log:
        server = popen(cmd, stdout=log, stderr=log)
    try:
        url = f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?run=.&tag=train%2Floss"
        logged = len([r for r in records if "loss" in r])
        points = wait_for_json(url, logged, limit=120)  # a loaded 2-core machine imports TensorBoard slowly
        served = {step: value for _, step, value in points}  # [wall time, step, value]
        assert_same({"train/loss": served}, {"train/loss": expected_scalars(records)["train/loss"]})
    finally:
        kill_group(server)
        server.wait(timeout=30)


def test_the_slow_process_is_named_with_its_host_at_every_log_line(slowed):
    _, out, records = slowed
    logs = [r for r in records if "loss" in r]
    assert [r["slow_ranks"] for r in logs] == [[1]] * len(logs), [r.get("rank_ms") for r in logs]
    assert all(r["rank_ms"][1] > SLOW_MS * 0.9 for r in logs)  # per step: one batch of 4 sequences
    named = re.findall(r"^step (\d+) \| .*\nslow: rank (\d) on (\S+), ([0-9.]+)x the median$", out, re.M)
    assert [(int(step), int(rank)) for step, rank, *_ in named] == [(r["step"], 1) for r in logs], out[-3000:]


def test_each_process_writes_a_trace_and_prints_its_breakdown(slowed):
    """Each process writes a trace with its collectives and prints its breakdown, and the profiler's
    engine says nothing (its start and stop lines, written in two parts, split other processes' lines).
    Mutation: KINETO_LOG_LEVEL 5 -> fails."""
    folder, out, _ = slowed
    assert "profiler_start" not in out and "profiler_stop" not in out, out[-3000:]
    for rank in (0, 1):
        trace = json.loads((folder / "traces" / f"rank{rank}.json").read_text())  # Chrome's format
        names = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
        assert "gloo:all_reduce" in names, sorted(names)[:50]
        line = re.search(rf"^\[rank {rank}\] steps 5-6 traced to .*: {BREAKDOWN}$", out, re.M)
        assert line, out[-3000:]
        compute, collectives, overlapped = (float(g) for g in line.groups()[:3])
        assert compute > 0 and collectives > 0 and 0 <= overlapped <= min(compute, collectives)


def test_the_breakdown_counts_overlapping_spans_once_and_their_overlap():
    breakdown = import_gpt_module("observability.traces").breakdown
    spans = [  # (name, category, start, duration) in microseconds
        ("aten::mm", "cpu_op", 0, 1000),
        ("aten::add", "cpu_op", 500, 1000),  # nested in time with the first: 0-1500 in all
        ("c10d::allreduce_", "cpu_op", 1500, 100),  # hands the collective over: not compute
        ("gloo:all_reduce", "user_annotation", 1000, 2000),  # 1000-3000, 500 of it beside compute
        ("aten::mm", "cpu_op", 4000, 1000),
    ]
    trace = {"traceEvents": [{"ph": "X", "name": n, "cat": c, "ts": t, "dur": d} for n, c, t, d in spans]}
    assert breakdown(trace) == {"compute": 2.5, "collectives": 2.0, "overlapped": 0.5}


# ---- the benchmark's comparisons (make bench-gpt) ----------------------------------------------------------
COMPARISONS = [("--shards", "shards", "in_memory", 0.98), ("--metrics", "metrics_on", "metrics_off", 0.99)]


@pytest.mark.parametrize("flag, variant, baseline, goal", COMPARISONS)
def test_the_benchmark_prints_the_ratio_of_the_two_runs_it_made(
    tmp_path, cache, flag, variant, baseline, goal
):
    cmd = [PYTHON, BENCH_GPT, flag, "--rounds", 1, "--steps", 4, "--log_every", 2, *BENCH_FORKED]
    cmd += ["--global_batch", 8, "--cache_dir", cache, "--out", tmp_path / "out.json", "--"]
    cmd += ["--n_layer", 1, "--n_head", 2, "--n_embd", 16, "--block_size", 16]
    proc = run(cmd, timeout=900)
    printed = re.search(rf"ratio {variant}/{baseline} \(goal >= {goal}\) ([0-9.]+)", proc.stdout)
    report = json.loads((tmp_path / "out.json").read_text())
    (base,), (other,) = report["tokens_per_s"][baseline], report["tokens_per_s"][variant]
    assert float(printed.group(1)) == pytest.approx(other / base, abs=1e-3), proc.stdout
    assert report["ratio"] == pytest.approx(other / base, abs=1e-3)


def test_plot_trace_draws_the_traces_of_every_process(slowed, tmp_path):
    folder, _, _ = slowed
    run([PYTHON, REPO / "benchmarks/plot_trace.py", folder / "traces", tmp_path / "trace.png"], timeout=300)
    assert (tmp_path / "trace.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = [PYTHON, REPO / "benchmarks" / "plot_trace.py", tmp_path, tmp_path / "x.png"]
    proc = run(empty, timeout=300, check=False)
    assert proc.returncode == 2 and "holds no rank*.json trace" in proc.stdout, proc.stdout
    assert not (tmp_path / "x.png").exists()
