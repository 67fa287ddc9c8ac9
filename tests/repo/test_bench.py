"""The benchmark harness: its report, plots and loss agreement from the smallest run that has every part of a
report (one process, the tutorial's loop on data of its own, and two ranks); every other variant's command
and its place in the report are checked without training.

Budget: one bench run of 3 trainings of 2 epochs of 64 samples. Measured back to back on 2 cores at load
average 10 to 15 (a CI run beside it): this file 85 s of wall time and 22 s of CPU time; the whole harness of
8 trainings it ran before, 217 s and 67 s. loss_memory.py's brief run (4 processes): 49 s of wall time at load
average 5 to 8, 23 s of CPU time.
"""

import json
import math
import re

import lessons as bench  # benchmarks/lessons.py (conftest puts benchmarks/ on sys.path)
import link  # benchmarks/link.py
import pytest
from helpers import PYTHON, REPO, run

# What the quick report has on a machine without GPUs: every variant, and every ratio both sides of which ran.
VARIANTS = ["plain", "tutorial", "tutorial_mse", "ddp_ws1", "spawn", "torchrun", "accelerate", "two_nodes"]
RATIOS = [
    "plain/tutorial",
    "plain/tutorial_mse",
    "ddp_ws1/plain",
    "accelerate/torchrun",
    "torchrun/plain",
    "two_nodes/torchrun",
    "spawn/torchrun",
]
# What the test runs: one process, the tutorial's loop (its own data, the ratio with a target) and two ranks.
RUN = ["plain", "tutorial", "torchrun"]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    tiny = ["--workloads", "tiny", "--repeats", "1", "--epochs", "2", "--tiny_size", "64", "--variants", *RUN]
    proc = run([PYTHON, REPO / "benchmarks" / "lessons.py", "--out", out, *tiny], timeout=600)
    return out, proc.stdout, json.loads((out / "bench.json").read_text())


def test_report_has_every_variant_run_and_their_ratios(bench_run):
    out, stdout, report = bench_run
    assert {"machine", "settings", "summary", "runs"} <= set(report)
    assert {"cpu", "cores", "torch", "accelerate", "backend", "commit"} <= set(report["machine"])
    assert report["settings"]["global_batch"] == 32  # the tutorial's batch
    part = report["summary"]["tiny"]
    assert list(part["variants"]) == RUN
    for row in part["variants"].values():
        assert {"mean", "std", "min", "max", "n", "step_ms", "ranks", "final_loss"} <= set(row)
        assert row["mean"] > 0 and row["n"] == 1
    assert part["variants"]["torchrun"]["ranks"] == 2
    assert list(part["ratios"]) == ["plain/tutorial", "torchrun/plain"]
    assert part["ratios"]["plain/tutorial"]["verdict"].startswith("target >= 1.1: ")  # the tiny target
    # throughput leaves out the warm-up epoch
    first = report["runs"][0]
    assert first["samples_per_s"] == pytest.approx(first["epochs"][-1]["samples_per_s"])
    # every epoch timed from the arrivals of its line: intervals that tile, start-up included, part of the run
    size = report["settings"]["tiny_size"]
    for r in report["runs"]:
        assert [e["epoch"] for e in r["epochs"]] == [1, 2], r["variant"]
        speeds = [e["samples_per_s"] for e in r["epochs"]]
        assert all(math.isfinite(x) and x > 0 for x in speeds), (r["variant"], speeds)
        assert sum(size / x for x in speeds) <= r["wall_s"], (r["variant"], speeds, r["wall_s"])
    # the same tables printed and written, every variant and ratio a row
    table = (out / "table.md").read_text()
    assert table in stdout
    for name in [*RUN, "plain/tutorial", "torchrun/plain"]:
        assert f"\n| {name} | " in table, name


def test_plots_are_written(bench_run):
    out, _, _ = bench_run
    for name in ("loss.png", "throughput.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000, name


def test_loss_curves_agree(bench_run):
    """The same seed, data and global batch: two ranks take the same steps as one process. Mutation: each
    process given the global batch instead of its share: torchrun's losses differ from plain's."""
    _, _, report = bench_run
    runs = {r["variant"]: r["losses"] for r in report["runs"]}
    assert len(runs["plain"]) == 2
    assert runs["torchrun"] == pytest.approx(runs["plain"], rel=1e-4)
    # the tutorial trains on data of its own: not compared
    assert set(report["summary"]["tiny"]["max_abs_loss_diff_vs_plain"]) == {"torchrun"}


def test_samples_per_s_from_arrivals():
    """An epoch's samples/s: the dataset over the time since the previous epoch line arrived, the first since
    the start; other lines, prefixes and colours ignored. Mutation: the division dropped (the interval
    returned): [4.0, 2.0, 1.0] != [16.0, 32.0, 64.0]."""
    assert bench.rates([5.0, 7.0, 8.0], 1.0, 64) == [16.0, 32.0, 64.0]
    assert bench.rates([], 1.0, 64) == []
    lines = [
        (2.0, "training on cpu\n"),
        (3.0, "[node0] epoch 1/3 | loss 0.5 | world_size 2\n"),
        (3.5, "epoch 0: model saved to snapshot.pt\n"),  # the tutorial's loop
        (4.0, "\x1b[36m(RayTrainWorker pid=1)\x1b[0m epoch 2/3 | loss 0.25 | world_size 2\n"),
        (6.0, "epoch 3/3 | loss 1e-05 | world_size 2\n"),
    ]
    epochs = bench.parse_epochs(lines, 1.0, 64)
    assert [list(e) for e in epochs] == [["epoch", "loss", "samples_per_s", "world_size"]] * 3
    assert [(e["epoch"], e["loss"], e["samples_per_s"]) for e in epochs] == [
        (1, 0.5, 32),
        (2, 0.25, 64),
        (3, 1e-5, 32),
    ]


def test_link_samples_per_s_from_docker_timestamps():
    """link.py: Docker's timestamps of node0's epoch lines, epoch 1 left out."""
    logs = "".join(
        [
            "2026-11-28T01:02:00.5Z training on cpu\n",
            "2026-11-28T01:02:01.000000000Z epoch 1/3 | loss 0.9 | world_size 2\n",
            "2026-11-28T01:02:03.000000000Z epoch 2/3 | loss 0.5 | world_size 2\r\n",
            "2026-11-28T01:02:03.500000000Z epoch 3/3 | loss 0.25 | world_size 2\n",
        ]
    )
    assert link.epoch_rates(logs, 256) == pytest.approx([128.0, 512.0])
    assert link.epoch_rates(logs.splitlines()[1], 256) == []


def processes(cmd):
    """How many training processes one command line starts."""
    per_node = [a.split("=", 1)[1] for a in cmd if a.startswith("--nproc-per-node=")]
    if per_node:
        return int(per_node[0])
    return int(cmd[cmd.index("--nproc") + 1]) if "--nproc" in cmd else 1


def test_every_variant_starts_its_ranks_and_has_its_rows():
    """Without training: the default variants on 2 ranks, the processes their commands start, and a report
    of made-up runs of all of them, with every variant and ratio in the tables. Mutation: two_nodes given
    `ranks` processes per node instead of `ranks // 2`: assert 4 == 2."""
    variants = bench.make_variants(2)
    assert [v.name for v in variants] == VARIANTS
    for v in variants:
        commands = v.command(["2", "2"], "tiny")
        assert sum(map(processes, commands)) == v.ranks, (v.name, commands)
        assert len(commands) == (2 if v.name == "two_nodes" else 1), v.name
        # the vision workload: the same lesson, run by examples/vision.py
        vision = v.command(["2", "2"], "vision")
        assert all(cmd[cmd.index(str(REPO / "examples" / "vision.py")) + 1].endswith(".py") for cmd in vision)
    settings = {"workloads": ["tiny"], "gpus": 0, "global_batch": 32, "tiny_size": 64, "mode": "quick"}
    settings |= {"repeats": 1, "epochs": 2, "load_before": [0.0], "load_after": [0.0]}
    results = [
        {"workload": "tiny", "variant": v.name, "round": 1, "samples_per_s": 100.0 + i, "losses": [2.0, 1.0]}
        for i, v in enumerate(variants)
    ]
    summary = bench.summarize(results, variants, settings)
    assert list(summary["tiny"]["variants"]) == VARIANTS
    assert list(summary["tiny"]["ratios"]) == RATIOS
    machine = dict.fromkeys(["date_utc", "cpu", "python", "torch", "accelerate", "commit"], "")
    table = bench.markdown(summary, settings, {**machine, "cores": 2, "gpus": [], "backend": "gloo"})
    for name in VARIANTS + RATIOS:
        assert f"\n| {name} | " in table, name


# ---- benchmarks/loss_memory.py ---------------------------------------------------------------------------
# a row of its table: dtype, the two peaks (MiB; then what each keeps for backward), the seconds, the losses
ROW_RE = re.compile(
    r"^\| (\S+) \| ([\d,]+), [-\d,]+ \| ([\d,]+), [-\d,]+ \| [\d. /]+ \| ([\d.]+) / ([\d.]+) \|$", re.M
)


def test_the_loss_in_chunks_never_holds_the_float32_logits():
    """loss_memory.py, briefly (4096 positions, a vocabulary of 4000, width 16, chunks of 256): in float32
    and under bf16 autocast the chunked loss's peak stays below the float32 logits' size (63 MiB) and the
    whole logits' peak reaches twice it (their float32 copy and its log-softmax); the two losses agree.
    Mutation: --chunk 4096 (one chunk: the whole logits at once): the chunks' peak passes 63 MiB and this
    fails."""
    cmd = [PYTHON, REPO / "benchmarks" / "loss_memory.py", "--vocab", 4000, "--tokens", 4096, "--width", 16]
    proc = run([*cmd, "--chunk", 256, "--dtypes", "fp32", "bf16"], timeout=600)
    logits_mib = 4096 * 4032 * 4 / 2**20
    rows = {dtype: row for dtype, *row in ROW_RE.findall(proc.stdout)}
    assert set(rows) == {"fp32", "bf16"}, proc.stdout
    for dtype, (whole, chunks, whole_loss, chunks_loss) in rows.items():
        whole, chunks = (float(v.replace(",", "")) for v in (whole, chunks))
        assert chunks < logits_mib < 2 * logits_mib < whole, (dtype, chunks, whole)
        assert abs(float(whole_loss) - float(chunks_loss)) < 1e-4, (dtype, whole_loss, chunks_loss)


def test_cpu_attention_times_each_type_and_names_the_gpts_choice(capsys, monkeypatch):
    """benchmarks/cpu_attention.py in process, at a short and a long sequence of width 32: a row for each,
    every kind timed, and the GPT's choice as model.attends_in_float32 makes it on a CPU with AMX: the
    float32 cast for fp16 always, for bf16 below 1024 tokens of width 32; torch's thread count as it was.
    Mutation: the row's choice read for fp16 from bf16 -> "own" for fp16 at 1024."""
    import cpu_attention  # benchmarks/cpu_attention.py
    import torch

    monkeypatch.setitem(cpu_attention.attends_in_float32.__globals__, "CPU_HAS_AMX", True)

    threads = torch.get_num_threads()
    rows = cpu_attention.main(["--lengths", "8", "1024", "--widths", "32", "--rounds", "1", "--tokens", "64"])
    assert torch.get_num_threads() == threads  # its 1 thread left behind for the tests after it
    assert [(r["width"], r["length"]) for r in rows] == [(32, 8), (32, 1024)]
    assert all(set(r["ms"]) == set(cpu_attention.KINDS) and min(r["ms"].values()) > 0 for r in rows), rows
    lines = [line.split("|") for line in capsys.readouterr().out.splitlines()[2:]]
    assert [line[-1].split() for line in lines] == [["cast", "cast"], ["own", "cast"]], lines
