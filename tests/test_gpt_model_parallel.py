"""The GPT trainer's model-parallel strategies: tensor parallel (--parallel tp) and pipeline parallel
(--parallel pp, GPipe and 1F1B) end where one process with the same global batch ends, resume exactly, and
refuse sizes that do not split before any process group forms. Budget: about 3 minutes on 2 cores."""

import re

import pytest
from conftest import TORCHRUN, load_snapshot, run
from test_gpt import (  # noqa: F401  (cache: a fixture)
    TRAIN,
    VAL_RE,
    assert_identical,
    assert_stopped_and_resumed_ends_bit_identical,
    cache,
    import_gpt_module,
    max_diff,
    train,
)

# 3 layers: 3 pipeline stages have one block each, 2 stages one and two
RUN = ["--n_layer", 3, "--max_steps", 40, "--decay_steps", 40, "--batch_size", 16, "--eval_every", 20]


@pytest.fixture(scope="module")
def one(tmp_path_factory, cache):  # noqa: F811
    """One process, 40 steps, stopped at 20 (resuming is exact, as test_gpt.py shows): (folder, output)."""
    cwd = tmp_path_factory.mktemp("one")
    out = train(cwd, cache, *RUN, "--max_steps", 20).stdout
    (cwd / "step20.pt").write_bytes((cwd / "gpt_snapshot.pt").read_bytes())
    return cwd, out + train(cwd, cache, *RUN).stdout


def assert_matches_one_process(cwd, out, one):
    mine, ref = load_snapshot(cwd / "gpt_snapshot.pt"), load_snapshot(one[0] / "gpt_snapshot.pt")
    assert mine["model"].keys() == ref["model"].keys()
    # float summation order, amplified by Adam: 1e-6 to 3e-6 measured (tp, pp) after 40 steps
    assert max_diff(mine["model"], ref["model"]) < 1e-4
    # the optimizer state as one process holds it, so any strategy resumes from it
    assert mine["optimizer"]["param_groups"] == ref["optimizer"]["param_groups"]
    for i, state in ref["optimizer"]["state"].items():
        assert max_diff(mine["optimizer"]["state"][i], state) < 1e-4
    val = {int(s): float(v) for s, v in VAL_RE.findall(out)}
    ref_val = {int(s): float(v) for s, v in VAL_RE.findall(one[1])}
    assert 40 in val and all(abs(val[s] - ref_val[s]) < 1e-3 for s in val), (val, ref_val)
    assert "sample:" in out


def test_tp_on_2_ranks_equals_one_process_with_the_same_global_batch(tmp_path, cache, one):  # noqa: F811
    proc = train(tmp_path, cache, *RUN, "--parallel", "tp", nproc=2)
    assert "global batch 16 x 64 tokens" in proc.stdout  # both ranks read the same 16 sequences
    assert re.search(r"^final unsplit weights identical on 2 ranks$", proc.stdout, re.M)
    assert_matches_one_process(tmp_path, proc.stdout, one)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pp_on_2_ranks_equals_one_process_with_the_same_global_batch(tmp_path, cache, one, schedule):  # noqa: F811
    args = ["--parallel", "pp", "--pp_schedule", schedule, "--pp_microbatches", 4]
    proc = train(tmp_path, cache, *RUN, *args, nproc=2)
    # the first and the last stage end with the same copy of the token embedding (also the head)
    assert re.search(r"^final token embedding \(also the head\) identical on 2 ranks$", proc.stdout, re.M)
    assert_matches_one_process(tmp_path, proc.stdout, one)


def test_pp_on_3_ranks_resumes_a_one_process_snapshot_and_ends_where_one_process_does(
    tmp_path,
    cache,  # noqa: F811
    one,
):
    # snapshots hold the whole model as one process does, so any strategy resumes from any other's
    (tmp_path / "gpt_snapshot.pt").write_bytes((one[0] / "step20.pt").read_bytes())
    proc = train(tmp_path, cache, *RUN, "--parallel", "pp", "--pp_microbatches", 8, nproc=3)
    assert "resuming from gpt_snapshot.pt at step 20" in proc.stdout, proc.stdout[-2000:]
    assert re.search(r"^final token embedding \(also the head\) identical on 2 ranks$", proc.stdout, re.M)
    assert_matches_one_process(tmp_path, proc.stdout, one)


def test_tp_stopped_and_resumed_ends_bit_identical(tmp_path, cache):  # noqa: F811
    # dropout on: every rank's random stream must continue exactly, and the ranks must draw alike
    args = ["--batch_size", 8, "--dropout", 0.1, "--decay_steps", 20, "--save_every", 7, "--parallel", "tp"]
    assert_stopped_and_resumed_ends_bit_identical(tmp_path, cache, args, 10, 20, nproc=2)


# ---- sizes that do not split: refused before any process group forms ----------------------------------
@pytest.mark.parametrize(
    ("world", "args", "message"),
    [
        (3, ["--parallel", "pp", "--n_layer", "2"], "3 pipeline stages (WORLD_SIZE) but only 2 layers"),
        (2, ["--parallel", "pp", "--batch_size", "6"], "--pp_microbatches 4 does not divide --batch_size 6"),
        (3, ["--parallel", "pp", "--pp_microbatches", "2"], "--pp_microbatches 2 for 3 stages (WORLD_SIZE)"),
        (2, ["--parallel", "pp", "--grad_accum", "2"], "--grad_accum 2: accumulate with --pp_microbatches"),
        (2, ["--parallel", "tp", "--n_head", "3", "--n_embd", "48"], "--n_head 3 does not divide into 2"),
        (2, ["--parallel", "tp", "--comm_hook", "bf16"], "--parallel tp has none"),
        (2, ["--parallel", "pp", "--comm_hook", "fp16"], "--parallel pp has none"),
    ],
)
def test_sizes_that_do_not_split_get_an_argparse_error(monkeypatch, capsys, world, args, message):
    monkeypatch.setenv("WORLD_SIZE", str(world))  # as torchrun sets it
    with pytest.raises(SystemExit) as exc:
        import_gpt_module("config").parse_args(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_under_torchrun_a_bad_size_stops_every_process_before_training_and_writes_nothing(tmp_path):
    args = [TRAIN, "--parallel", "tp", "--n_head", 3, "--n_embd", 48, "--metrics_path", "m.jsonl"]
    args += ["--cache_dir", tmp_path / "cache"]
    proc = run(
        [*TORCHRUN, "--standalone", "--nproc-per-node=2", *args], timeout=120, check=False, cwd=tmp_path
    )
    assert proc.returncode != 0
    assert proc.stdout.count("--n_head 3 does not divide into 2 processes (WORLD_SIZE)") == 2, proc.stdout
    assert "exitcode  : 2" in proc.stdout and not re.search(r"^step ", proc.stdout, re.M), proc.stdout
    assert not list(tmp_path.iterdir())  # no snapshot, no metrics, not even the corpus cache
