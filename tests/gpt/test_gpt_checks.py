"""What the GPT trainer checks and decides for itself: bad numbers and unwritable snapshot paths refused
before any work, the presets' warmup, replicas that differ named, a diverging loss stopped before its
update reaches a snapshot, the dtype it picks where bf16 is only emulated, and MFU against each GPU's own
peak. Mostly in-process and short runs of the tiny model."""

import argparse
import json
import math
import os
import re

import pytest
import torch
from gpt_helpers import TRAIN, run, saved, train
from helpers import PYTHON, import_gpt_module


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max_steps", "0"], "--max_steps must be positive, got 0"),
        (["--batch_size", "-4"], "--batch_size must be positive, got -4"),
        (["--grad_accum", "0"], "--grad_accum must be positive, got 0"),
        (["--n_head", "0"], "--n_head must be positive, got 0"),  # before --n_embd % --n_head
        (["--n_embd", "30", "--n_head", "4"], "--n_embd 30 is not a multiple of --n_head 4"),
        (["--dropout", "1.5"], "--dropout must be in [0, 1)"),
        (["--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
        (["--model", "huge"], "argument --model: invalid choice: 'huge'"),
        (["--lr", "inf"], "--lr must be a finite number, got inf"),
        (["--lr", "nan"], "--lr must be a finite number, got nan"),
        (["--weight_decay", "inf"], "--weight_decay must be a finite number, got inf"),
        (["--parallel", "pp"], "--parallel pp needs at least 2 processes"),  # WORLD_SIZE unset: one process
        (["--snapshot_path", "blocker/s.pt"], "--snapshot_path blocker/s.pt: "),
        (["--metrics_path", "blocker/deeper/m.jsonl"], "--metrics_path blocker/deeper/m.jsonl: "),
        (["--restarts"], "restarts need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun"),
        (["--profile_steps", "3:2"], "argument --profile_steps: expected 1 <= FIRST <= LAST, got '3:2'"),
        (["--profile_steps", "3"], "argument --profile_steps: expected FIRST:LAST, two step numbers"),
        (["--profile_dir", "blocker/t"], "--profile_dir blocker/t: "),
        (["--slow_factor", "0.5"], "--slow_factor must be 0 or 1 or more, got 0.5"),
        (["--memory_snapshot", "m.pickle"], "--memory_snapshot records CUDA allocations: it needs a GPU"),
        (["--compile_mode", "max-autotune-no-cudagraphs"], "max-autotune-no-cudagraphs is for --compile"),
        (["--batchsize", "4"], "unrecognized arguments: --batchsize 4 (did you mean --batch_size?)"),
        (["--lr=1", "--max-steps=2"], "unrecognized arguments: --max-steps=2 (did you mean --max_steps?)"),
    ],
)
def test_nonsense_numbers_get_an_argparse_error(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same on a machine with GPUs
    (tmp_path / "blocker").write_text("a file where a folder would have to be")
    if args == ["--restarts"]:  # what torchrun --max-restarts=3 tells its workers when it shares its store
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
        monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
        args = []
    config = import_gpt_module("config")
    with pytest.raises(SystemExit) as exc:
        config.parse_args(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "warmup", "said"),
    [
        (["--max_steps", "20"], 2, "the preset's warm-up cut to 2 steps from 20: 10% of --max_steps"),
        (["--max_steps", "300"], 20, None),  # the preset's own run: as it was
        (["--max_steps", "20", "--warmup_steps", "5"], 5, None),  # given: kept (resumed runs rely on it)
    ],
)
def test_the_presets_warmup_is_at_most_a_tenth_of_the_run(args, warmup, said, capsys):
    """--max_steps 20 with the preset's 20 warm-up steps would never reach the learning rate."""
    _, parsed = import_gpt_module("config").parse_args([*args, "--model", "cpu"])
    assert parsed.warmup_steps == warmup
    out = capsys.readouterr().out
    assert (said in out) if said else "warm-up cut" not in out, out


def test_a_snapshot_path_that_cannot_be_written_is_found_before_any_work(tmp_path):
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / "file").write_text("")
    args = ["--snapshot_path", "ro/file/gpt.pt", "--metrics_path", "m.jsonl", "--max_steps", "5"]
    proc = run([PYTHON, TRAIN, *args], timeout=120, check=False, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:]
    assert "--snapshot_path ro/file/gpt.pt: " in proc.stdout and "is not a directory" in proc.stdout
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["file", "ro"]  # no metrics, no snapshot


def test_replicas_that_differ_are_named():
    mesh, replicas = import_gpt_module("parallel.mesh"), import_gpt_module("parallel.replicas")
    hsdp = mesh.Layout(dp_replicate=2, dp_shard=2)  # ranks 0 and 2 hold one shard, 1 and 3 the other
    same = [{"dp_shard": "a"}, {"dp_shard": "b"}, {"dp_shard": "a"}, {"dp_shard": "b"}]
    assert replicas.replica_mismatches(hsdp, same) == (4, [])
    differ = [{"dp_shard": "a"}, {"dp_shard": "b"}, {"dp_shard": "a"}, {"dp_shard": "c"}]
    assert replicas.replica_mismatches(hsdp, differ) == (4, ["dp_shard weights of ranks [1, 3]: ['b', 'c']"])
    pp = mesh.Layout(pp=2)  # the tied embedding: the first stage's copy and the last's
    assert replicas.replica_mismatches(pp, [{"": "x", "tied": "t"}, {"": "y", "tied": "u"}])[1] == [
        "tied weights of ranks [0, 1]: ['t', 'u']"
    ]


def test_an_existing_snapshot_folder_must_itself_be_writable(tmp_path, monkeypatch):
    options = import_gpt_module("options")
    snapshots = tmp_path / "gpt_snapshot"
    snapshots.mkdir()
    assert options.unwritable(str(snapshots)) is None
    access = os.access  # as root every folder is writable: refuse this one folder as a read-only mount would
    monkeypatch.setattr(os, "access", lambda path, mode: str(path) != str(snapshots) and access(path, mode))
    assert options.unwritable(str(snapshots)) == f"{snapshots} is not writable"
    assert options.unwritable(str(tmp_path / "new" / "gpt_snapshot")) is None  # its parent is writable


def test_divergence_stops_before_its_update_and_never_reaches_a_snapshot(tmp_path, cache):
    train(tmp_path, cache, "--max_steps", 10, "--save_every", 10)
    # from step 10 on, an lr of 1e30, a snapshot due after every step: step 11's update gives weights of
    # about 1e29, finite, whose loss at step 12 is not; the snapshot of step 11 must never be written
    proc = train(tmp_path, cache, "--max_steps", 30, "--save_every", 1, "--lr", 1e30, check=False)
    assert proc.returncode == 1, proc.stdout[-2000:]
    stopped = r"error: the loss became (nan|inf) at step (1[1-5]), before its update: training stopped, "
    match = re.search(stopped + r"the newest snapshot is gpt_snapshot/step-000000(\d\d)-", proc.stdout)
    assert match, proc.stdout[-2000:]
    assert "Traceback" not in proc.stdout
    newest = saved(tmp_path)
    assert newest["step"] == int(match[3]) < int(match[2])
    tensors = [*newest["model"].values()]
    tensors += [t for state in newest["optimizer"]["state"].values() for t in state.values()]
    assert all(t.isfinite().all() for t in tensors)
    # (the head's frozen bias scores the padded vocabulary -10000 by design)
    assert max(t.abs().max().item() for k, t in newest["model"].items() if k != "head.bias") < 100
    # the default --keep 2: the two newest step directories
    assert len([d for d in (tmp_path / "gpt_snapshot").iterdir() if d.is_dir()]) == min(2, newest["step"] - 9)
    resumed = train(tmp_path, cache, "--max_steps", newest["step"] + 5, "--metrics_path", "m.jsonl")
    assert f"resuming from gpt_snapshot at step {newest['step']} (step-" in resumed.stdout
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    losses = [r for r in records if "grad_norm" in r]
    assert losses and all(math.isfinite(r["loss"]) and 0 < r["grad_norm"] < 100 for r in losses), records
    val_losses = [r["val_loss"] for r in records if "val_loss" in r]
    assert val_losses[-1] < 4.5, records  # as before the lr of 1e30 (val loss 3.9 at step 10)


def test_auto_dtype_takes_fp16_where_bf16_is_only_emulated(monkeypatch):
    mesh = import_gpt_module("parallel.mesh")
    native = {"value": False}  # a GPU before compute capability 8.0: torch emulates bf16 there
    monkeypatch.setattr(
        torch.cuda,
        "is_bf16_supported",
        lambda including_emulation=True: including_emulation or native["value"],
    )
    assert mesh.resolve_dtype("auto", torch.device("cuda")) == torch.float16
    native["value"] = True
    assert mesh.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert mesh.resolve_dtype("auto", torch.device("cpu")) == torch.float32


def test_mfu_uses_each_gpus_own_peak(monkeypatch):
    metrics = import_gpt_module("observability.metrics")
    args = argparse.Namespace(peak_tflops=None)
    expected = {
        "NVIDIA H100 NVL": 835e12,
        "NVIDIA H100 80GB HBM3": 989e12,
        "NVIDIA H100 PCIe": 756e12,
        "NVIDIA H200 NVL": 835e12,
        "NVIDIA H200": 989e12,
    }
    for name, peak in expected.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert metrics.peak_flops(args, torch.device("cuda")) == peak, name


def test_mfu_is_recorded_by_this_trainers_count_and_by_llm_cs(tmp_path, cache):
    """GPT-2 small's training FLOPs a token by both counts: llm.c's from its 124,475,904 parameters (as
    train_gpt2.cu prints them) and attention as 6 * layers * width * context; this trainer's without the
    position embedding and attention as 12 * layers * width * context. The metrics record both MFUs.
    Mutation: llm.c's attention counted as 12 * layers * width * context -> this fails."""
    model_mod = import_gpt_module("model")
    with torch.device("meta"):
        gpt2 = model_mod.GPT(model_mod.GPTConfig(50257, 1024, n_layer=12, n_head=12, n_embd=768))
    attention = 12 * 768 * 1024
    assert model_mod.flops_per_token(gpt2, llmc=True) == 6 * 124_475_904 + 6 * attention
    assert model_mod.flops_per_token(gpt2) == 6 * (124_475_904 + 50304 - 1024 * 768) + 12 * attention
    args = ["--max_steps", 5, "--sample_chars", 0, "--peak_tflops", 1, "--metrics_path", "m.jsonl"]
    train(tmp_path, cache, *args)
    (logged,) = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()[:1]]
    with torch.device("meta"):  # TINY's shape, on the default corpus's 96 characters
        tiny = model_mod.GPT(model_mod.GPTConfig(96, 64, n_layer=2, n_head=2, n_embd=64, bias=False))
    ratio = model_mod.flops_per_token(tiny, llmc=True) / model_mod.flops_per_token(tiny)
    assert logged["mfu_llmc"] == pytest.approx(logged["mfu"] * ratio), logged


def test_bad_numbers_exit_2_from_the_command_line_and_write_nothing(tmp_path):
    """Two lines, the error last: not argparse's usage of every option (about 25 lines) above it. Mutation:
    options.Parser.error calling argparse's own -> fails."""
    proc = run(
        [PYTHON, TRAIN, "--max_steps", "-1", "--metrics_path", "m"], timeout=120, check=False, cwd=tmp_path
    )
    said = [
        "usage: train.py [options] (--help lists them)",
        "train.py: error: --max_steps must be positive, got -1",
    ]
    assert proc.returncode == 2 and proc.stdout.strip().splitlines() == said, proc.stdout
    assert not list(tmp_path.iterdir())


def test_fp16_overflows_in_a_row_end_as_a_divergence():
    """fp16: a step whose gradients overflow is the loss scale's (halved, the step skipped, nothing
    counted); 24 in a row (the scale from 2**16 down to 2**-8) end the run as diverged, in one line, where
    the scale would halve for ever. 23, a clean step, then 23 more go on. Mutations: the count not reset
    by a clean step -> the second 23 end the run; the bound left out -> the 24th goes on."""
    guards = import_gpt_module("failures.guards")
    checks = guards.Checks(skip_nonfinite=0, scaled=True, log=print)
    overflow, clean = torch.tensor([2.0, math.inf, math.inf, 0.0]), torch.tensor([2.0, 1.0, 1.0, 0.0])
    for step, values in enumerate([overflow] * 23 + [clean] + [overflow] * 23, start=1):
        checks.add(step, values)
    checks.read()
    checks.add(48, overflow)
    with pytest.raises(
        guards.Diverged, match=r"^fp16 gradients overflowed 24 steps in a row, the last at step 48"
    ):
        checks.read()
