"""The GPT trainer's layouts beyond plain data parallelism, on one device mesh: tensor parallel (--tp),
pipeline parallel (--pp, GPipe and 1F1B) and their compositions with FSDP (--dp_shard) and replicas
(--dp_replicate) end where one process with the same global batch ends, resume each other's snapshots, and
refuse sizes that do not split before any process group forms. tp and pp run 20 steps here, and 2-D
layouts resume snapshots of others; test_gpt_layouts.py runs every layout for a few steps, its validation
loss and its copies of replicated weights checked. About 3 minutes on 2 cores."""

import io
import json
import re
import shutil

import pytest
import torch
from gpt_helpers import (
    TRAIN,
    VAL_RE,
    assert_close,
    assert_stopped_and_resumed_ends_bit_identical,
    import_gpt_module,
    max_diff,
    run,
    saved,
    train,
)
from helpers import FORKRUN, GPT_ON_PATH, PROGRAMS, TORCHRUN

# 3 layers: 3 pipeline stages have one block each, 2 stages one and two. Global batch 16 everywhere.
# --grad_clip 0: a clipped step hides a gradient off by a constant factor from AdamW, and so from the tests.
# --bias yes: the layouts split biases too (tp's row-split ones stay whole); test_gpt_layouts.py runs the
# cpu preset's model without them
RUN = ["--n_layer", 3, "--max_steps", 20, "--decay_steps", 20, "--batch_size", 16, "--eval_every", 10]
RUN += ["--grad_clip", 0, "--bias", "yes"]
REPLICAS_RE = re.compile(r"^replicas identical: (\d+) copies compared across ranks$", re.M)


@pytest.fixture(scope="module")
def one(tmp_path_factory, cache):
    """One process, 20 steps, stopped at 10 (resuming is exact, as test_gpt.py shows): (folder, output)."""
    cwd = tmp_path_factory.mktemp("one")
    out = train(cwd, cache, *RUN, "--max_steps", 10).stdout
    shutil.copytree(cwd / "gpt_snapshot", cwd / "step10")
    return cwd, out + train(cwd, cache, *RUN).stdout


def assert_matches_one_process(cwd, out, one):
    mine, ref = saved(cwd), saved(one[0])
    assert mine["step"] == 20 and mine["model"].keys() == ref["model"].keys()
    # float summation order, amplified by Adam: 1.7e-6 to 2.0e-6 measured after 20 steps (2026-12-02)
    diff = max_diff(mine["model"], ref["model"])
    print(f"max parameter difference from one process after 20 steps: {diff:.3g}")
    assert diff < 1e-5
    assert_close(mine, ref)  # and the optimizer state as one process holds it, whoever held which part
    val = {int(s): float(v) for s, v in VAL_RE.findall(out)}
    ref_val = {int(s): float(v) for s, v in VAL_RE.findall(one[1])}
    assert 20 in val and all(abs(val[s] - ref_val[s]) < 1e-3 for s in val), (val, ref_val)
    assert "sample:" in out


def test_tp_on_2_ranks_equals_one_process_with_the_same_global_batch(tmp_path, cache, one):
    proc = train(tmp_path, cache, *RUN, "--parallel", "tp", nproc=2)
    assert "global batch 16 x 64 tokens" in proc.stdout  # both ranks read the same 16 sequences
    assert "layout tp 2" in proc.stdout
    assert REPLICAS_RE.search(proc.stdout).group(1) == "2"  # the unsplit weights: embeddings, norms
    assert_matches_one_process(tmp_path, proc.stdout, one)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pp_on_2_ranks_equals_one_process_with_the_same_global_batch(tmp_path, cache, one, schedule):
    args = ["--parallel", "pp", "--pp_schedule", schedule, "--pp_microbatches", 4]
    proc = train(tmp_path, cache, *RUN, *args, nproc=2)
    # the first and the last stage end with the same copy of the token embedding (also the head)
    assert REPLICAS_RE.search(proc.stdout).group(1) == "2"
    assert_matches_one_process(tmp_path, proc.stdout, one)


# ---- two dimensions: each degree a dimension of one mesh, global batch 16 in each ---------------------
# (every layout, up to three dimensions, ends where one process ends: test_gpt_layouts.py's matrix)
LAYOUTS = {
    "fsdp x tp": ["--dp_shard", 2, "--tp", 2, "--batch_size", 8],
    "pp x fsdp": ["--pp", 2, "--dp_shard", 2, "--batch_size", 8, "--pp_microbatches", 2],
}


# ---- any layout resumes any other's snapshot ---------------------------------------------------------
def test_pp_on_3_ranks_resumes_a_one_process_snapshot_exactly(
    tmp_path,
    cache,
    one,
):
    """pp on 3 ranks resumes a one process snapshot and ends where one process does."""
    shutil.copytree(one[0] / "step10", tmp_path / "gpt_snapshot")
    proc = train(tmp_path, cache, *RUN, "--parallel", "pp", "--pp_microbatches", 8, nproc=3)
    assert "resuming from gpt_snapshot at step 10" in proc.stdout, proc.stdout[-2000:]
    assert_matches_one_process(tmp_path, proc.stdout, one)


def test_a_2d_run_killed_after_its_first_snapshot_resumes_in_one_process(tmp_path, cache, one):
    # rank 0 is killed while it saves step 20 (programs/crash_at_save.py): the snapshot of step 10 remains
    args = [*RUN, *LAYOUTS["fsdp x tp"], "--save_every", 10]
    wrapper = PROGRAMS / "crash_at_save.py"
    crashed = train(tmp_path, cache, *args, nproc=4, script=wrapper, check=False)
    assert crashed.returncode != 0, crashed.stdout[-2000:]
    assert "saved gpt_snapshot at step 10" in crashed.stdout, crashed.stdout[-2000:]
    proc = train(tmp_path, cache, *RUN)
    assert "resuming from gpt_snapshot at step 10" in proc.stdout, proc.stdout[-2000:]
    assert_matches_one_process(tmp_path, proc.stdout, one)


def test_a_ddp_snapshot_resumes_as_pp_x_fsdp(tmp_path, cache, one):
    train(tmp_path, cache, *RUN, "--batch_size", 8, "--max_steps", 10, nproc=2)
    proc = train(tmp_path, cache, *RUN, *LAYOUTS["pp x fsdp"], nproc=4)
    assert "resuming from gpt_snapshot at step 10" in proc.stdout, proc.stdout[-2000:]
    assert_matches_one_process(tmp_path, proc.stdout, one)


def test_a_single_file_is_imported_into_a_sharded_layout(tmp_path, cache, one):
    checkpoint = import_gpt_module("snapshots.checkpoint")
    checkpoint.save_file(tmp_path / "step10.pt", saved(one[0], "step10"))
    args = ["--parallel", "fsdp", "--batch_size", 8, "--init_from", "step10.pt"]
    proc = train(tmp_path, cache, *RUN, *args, nproc=2)
    assert "resuming from step10.pt at step 10" in proc.stdout, proc.stdout[-2000:]
    assert_matches_one_process(tmp_path, proc.stdout, one)


def test_tp_stopped_and_resumed_ends_bit_identical(tmp_path, cache):
    # dropout on: every rank's random stream must continue exactly, and the ranks must draw alike
    args = ["--batch_size", 8, "--dropout", 0.1, "--decay_steps", 12, "--save_every", 4, "--parallel", "tp"]
    assert_stopped_and_resumed_ends_bit_identical(tmp_path, cache, args, 6, 12, nproc=2)


# ---- sizes that do not split: refused before any process group forms ----------------------------------
@pytest.mark.parametrize(
    ("world", "args", "message"),
    [
        (3, ["--parallel", "pp", "--n_layer", "2"], "--pp 3 pipeline stages but only 2 layers"),
        (2, ["--parallel", "pp", "--batch_size", "6"], "--pp_microbatches 4 does not divide --batch_size 6"),
        (3, ["--parallel", "pp", "--pp_microbatches", "2"], "--pp_microbatches 2 for 3 stages"),
        (2, ["--parallel", "pp", "--grad_accum", "2"], "--grad_accum 2: accumulate with --pp_microbatches"),
        (2, ["--parallel", "tp", "--n_head", "3", "--n_embd", "48"], "--n_head 3 does not divide into 2"),
        (2, ["--parallel", "tp", "--comm_hook", "bf16"], "--comm_hook is for DDP"),
        (2, ["--dp_shard", "2", "--comm_hook", "fp16"], "--comm_hook is for DDP"),
        (2, ["--parallel", "tp", "--compile", "--dropout", "0.1"], "--compile with --tp 2 and --dropout 0.1"),
        (2, ["--parallel", "tp", "--compile", "--ac", "full"], "--compile with --tp 2 and --ac full"),
        (2, ["--tp", "2", "--compile", "--ac", "selective"], "--compile with --tp 2 and --ac selective"),
        (4, ["--dp_shard", "2", "--tp", "3"], "= 6 processes, but WORLD_SIZE is 4"),
        (4, ["--tp", "4"], "--tp 4: --n_head 2 does not divide into 4 parts"),
        (4, ["--parallel", "zero", "--dp_shard", "2"], "--parallel zero splits AdamW's state over plain"),
        (2, ["--parallel", "fsdp", "--tp", "2"], "--parallel fsdp is shorthand for --dp_shard 2"),
        (2, ["--pp", "0", "--tp", "2"], "--pp must be positive, got 0"),
        (2, ["--parallel", "pp", "--pp_microbatches", "0"], "--pp_microbatches must be positive, got 0"),
    ],
)
def test_sizes_that_do_not_split_get_an_argparse_error(monkeypatch, capsys, world, args, message):
    monkeypatch.setenv("WORLD_SIZE", str(world))  # as torchrun sets it
    with pytest.raises(SystemExit) as exc:
        import_gpt_module("config").parse_args(["--n_head", "2", "--n_embd", "32", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()[-1]) > len(message), err


def test_under_torchrun_a_bad_size_stops_every_process_before_work(tmp_path):
    """Under torchrun a bad size stops every process before training and writes nothing."""
    args = [TRAIN, "--parallel", "tp", "--n_head", 3, "--n_embd", 48, "--metrics_path", "m.jsonl"]
    args += ["--cache_dir", tmp_path / "cache"]
    proc = run(
        [*TORCHRUN, "--standalone", "--nproc-per-node=2", *args], timeout=120, check=False, cwd=tmp_path
    )
    assert proc.returncode != 0
    message = "train.py: error: --tp 2: --n_head 3 does not divide into 2 parts"  # in torchrun's summary
    assert proc.stdout.count("does not divide") == 1, proc.stdout
    summary = [line for line in proc.stdout.splitlines() if line.strip()]
    assert summary[-1].startswith("=====")
    assert summary[-2].startswith(f"  failures.failure.Failed: {message}"), proc.stdout
    assert "exitcode  : 2" in proc.stdout and not re.search(r"^step ", proc.stdout, re.M), proc.stdout
    assert not list(tmp_path.iterdir())  # no snapshot, no metrics, not even the corpus cache


# ---- dropout under tp: each share of the heads draws its own masks, as distinct heads do in one process -
def test_tp_dropout_draws_distinct_masks_for_each_share_of_the_heads(tmp_path):
    cmd = [*FORKRUN, "--nproc-per-node=2", PROGRAMS / "tp_dropout.py", TRAIN.parent]
    proc = run(cmd, timeout=120, cwd=tmp_path, env=GPT_ON_PATH)
    assert "RESULT distinct" in proc.stdout, proc.stdout[-2000:]


# ---- a non-finite step seen by one process only: every process takes the same decision ---------------
@pytest.mark.parametrize("skip", [1, 0])
@pytest.mark.parametrize("step", [3, 2])
def test_a_non_finite_step_on_one_process_acts_on_every_process(tmp_path, cache, skip, step):
    """A step non finite on one process is skipped or stops on every process.

    Step 3 logs, so the host reads its checks before its update; step 2's are read with step 3's (an
    ordinary step reads nothing back): the step was skipped on the device, and is said, counted or
    stopped for when read. Mutations: found_inf not given to AdamW (the replicas differ: it updated on
    one process), or read() skipping all but the last step (step 2 is never said): both fail."""
    wrapper = PROGRAMS / "one_sided_nan.py"
    args = ["--parallel", "tp", "--max_steps", 6, "--log_every", 3, "--skip_nonfinite", skip]
    env = {"NAN_STEP": str(step)}
    proc = train(tmp_path, cache, *args, nproc=2, script=wrapper, check=False, env=env)
    if skip:
        assert proc.returncode == 0, proc.stdout[-3000:]
        assert (
            f"step {step}: loss nan, gradient norm" in proc.stdout
            and "skipped (1 of --skip_nonfinite 1)" in proc.stdout
        )
        # both processes skipped it: the weights tp does not split are still alike on both
        assert REPLICAS_RE.search(proc.stdout).group(1) == "2", proc.stdout[-3000:]
    else:
        assert proc.returncode == 1, proc.stdout[-3000:]
        assert f"error: the loss became nan at step {step}, before its update" in proc.stdout
        assert "nothing was saved" in proc.stdout and not (tmp_path / "gpt_snapshot").exists()


# ---- an ordinary step reads nothing back: the host waits for the device only where it logs or saves -----
@pytest.mark.parametrize("nproc", [None, 2])
def test_an_ordinary_step_reads_nothing_back_from_the_device(tmp_path, cache, nproc):
    """tests/programs/host_reads.py counts every value examples/gpt reads from a tensor, step by step
    (on a GPU also every synchronising call). Steps 4, 8, 12 log (8 evaluates, 12 is the last), 6 and 11
    follow a due snapshot: only those read; the others read 0. One process, and tp on 2, where every
    parameter must be a DTensor for the GPU's AdamW (fused or foreach) to take them. Mutations: the
    verdict read every step (as before: 2 reads a step), or tp's embeddings left plain tensors (a mix
    that foreach AdamW refuses): each fails."""
    args = ["--max_steps", 12, "--log_every", 4, "--eval_every", 8, "--save_every", 5, "--batch_size", 8]
    args += ["--parallel", "tp"] if nproc else []
    train(tmp_path, cache, *args, nproc=nproc, script=PROGRAMS / "host_reads.py")
    checked = [4, 6, 8, 11, 12]
    for rank in range(nproc or 1):
        found = json.loads((tmp_path / f"reads.rank{rank}.json").read_text())
        reads = {int(step): count for step, count in found["reads"].items()}
        assert found["checked"] == checked, found
        ordinary = {s: n for s, n in reads.items() if s not in checked}
        assert ordinary == {s: 0 for s in range(1, 13) if s not in checked}, reads
        assert all(reads[s] > 0 for s in checked), reads
        assert found["one_kind"] and found["foreach"], found


def per_rank(folder):
    """{rank: [(step, scale, moved), ...]} from the wrapper's files."""
    found = {}
    for rank in (0, 1):
        lines = (folder / f"steps{rank}.txt").read_text().split("\n")[:-1]
        found[rank] = [(int(a), float(b), c == "True") for a, b, c in (line.split() for line in lines)]
    return found


def test_fp16_overflow_on_one_process_skips_the_step_everywhere(tmp_path, cache):
    """fp16 overflow on one process skips the step and halves the scale on every process (fp16 autocast
    on the CPU, as on a GPU, from --loss_scale 1024). Mutation: the scaler's update left out -> fails."""
    wrapper = PROGRAMS / "one_sided_inf_gradient.py"
    args = ["--parallel", "ddp", "--batch_size", 8, "--max_steps", 7, "--log_every", 1, "--sample_chars", 0]
    args += ["--dtype", "fp16", "--loss_scale", 1024]
    proc = train(tmp_path, cache, *args, nproc=2, script=wrapper, env={"FP16": "1"}, check=False)
    steps = per_rank(tmp_path)
    # step 3 skipped, the scale halved; 3 clean steps later (4, 5, 6) it doubles back
    expected = [(1, 1024.0, True), (2, 1024.0, True), (3, 512.0, False), (4, 512.0, True)]
    expected += [(5, 512.0, True), (6, 1024.0, True), (7, 1024.0, True)]
    assert steps == {0: expected, 1: expected}, proc.stdout[-3000:]
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "skipped (" not in proc.stdout  # fp16's skip is not one of --skip_nonfinite's
    assert REPLICAS_RE.search(proc.stdout).group(1) == "2", proc.stdout[-3000:]


@pytest.mark.parametrize("skip", [1, 0])
def test_an_infinite_gradient_on_one_process_acts_on_every_process(tmp_path, cache, skip):
    """An infinite gradient on one process is skipped or stops every process."""
    wrapper = PROGRAMS / "one_sided_inf_gradient.py"
    args = ["--parallel", "ddp", "--batch_size", 8, "--max_steps", 5, "--log_every", 1, "--sample_chars", 0]
    proc = train(tmp_path, cache, *args, "--skip_nonfinite", skip, nproc=2, script=wrapper, check=False)
    moved = {rank: [m for _, _, m in steps] for rank, steps in per_rank(tmp_path).items()}
    if skip:
        assert proc.returncode == 0, proc.stdout[-3000:]
        assert re.search(r"^step 3: loss [0-9.]+, gradient norm inf: skipped \(1 of", proc.stdout, re.M)
        assert moved == {0: [True, True, False, True, True], 1: [True, True, False, True, True]}
        assert REPLICAS_RE.search(proc.stdout).group(1) == "2", proc.stdout[-3000:]
    else:
        assert proc.returncode == 1, proc.stdout[-3000:]
        assert "error: the gradient norm became inf at step 3, before its update" in proc.stdout
        assert moved == {0: [True, True], 1: [True, True]}, proc.stdout[-3000:]
        assert "nothing was saved" in proc.stdout and not (tmp_path / "gpt_snapshot").exists()


def test_the_loss_scale_and_its_clean_steps_survive_a_snapshot():
    guards = import_gpt_module("failures.guards")
    scaler = guards.LossScaler(True, scale=1024.0, interval=3)
    for overflow in (True, False, False):
        scaler.update(overflow)
    buffer = io.BytesIO()
    torch.save(scaler.state_dict(), buffer)  # as a snapshot holds it: plain numbers
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert state == {"scale": 512.0, "_growth_tracker": 2}
    restored = guards.LossScaler(True, interval=3)
    restored.load_state_dict(state)
    assert (restored.value, restored.clean) == (512.0, 2)
    restored.update(False)  # the third clean step in a row, counting those before the snapshot
    assert (restored.value, restored.clean) == (1024.0, 0)
    # torch's GradScaler's state (older snapshots) loads too; a disabled scaler saves and loads nothing
    restored.load_state_dict(torch.amp.GradScaler("cpu", init_scale=256.0).state_dict())
    assert restored.value == 256.0
    off = guards.LossScaler(False)
    off.load_state_dict(state)
    assert off.state_dict() == {} and off.scale(torch.tensor(3.0)).item() == 3.0


TP_ONE_RE = re.compile(
    r"^tp 1 on (\w+): every parameter a DTensor True, fused AdamW, loss ([0-9.]+) -> ([0-9.]+)$", re.M
)


def tp_at_world_size_1(tmp_path, env=None):
    """tests/programs/tp_one_process.py under torchrun: (backend, first loss, last loss)."""
    cmd = [*FORKRUN, "--nproc-per-node=1", PROGRAMS / "tp_one_process.py"]
    proc = run(cmd, timeout=300, cwd=tmp_path, env={**GPT_ON_PATH, **(env or {})})
    found = TP_ONE_RE.search(proc.stdout)
    assert found, proc.stdout[-3000:]
    return found[1], float(found[2]), float(found[3])


def test_tp_at_world_size_1_trains_with_fused_adamw(tmp_path):
    """The GPU's optimizer over tp's DTensors, with loss parallel and the device-side checks: the loss
    falls. tests/repo/test_gpu.py runs the same on NCCL. Mutation: the old plan (embeddings and head left
    plain tensors): fused AdamW refuses the mix at step 1 and this fails."""
    backend, first, last = tp_at_world_size_1(tmp_path)
    assert backend == "gloo" and last < first - 0.5, (backend, first, last)
