"""Sharded data parallelism in the GPT trainer: --parallel zero and fsdp against ddp, sharded snapshots that
resume on another number of processes, survive a crash mid-save, export to one file, and never run code
from a file they load. Tiny model, global batch 24 (2 x 12, 3 x 4 x 2 micro-batches, 1 x 24): about
1.5 minutes on 2 cores (97 s measured at load average 2 to 3)."""

import io
import pickle
import shutil

import pytest
import torch
from gpt_helpers import (
    GPT,
    RunsCode,
    assert_close,
    assert_identical,
    import_gpt_module,
    max_diff,
    run,
    saved,
    train,
)
from helpers import EXAMPLES, GPT_ON_PATH, PROGRAMS, PYTHON, free_port
from torch.distributed import checkpoint as dcp

EXPORT = GPT / "export.py"
# --grad_clip 0: a clipped step hides a gradient off by a constant factor from AdamW, and so from the tests
STEPS = ["--max_steps", 20, "--save_every", 10, "--sample_chars", 0, "--grad_clip", 0]
ON_2 = ["--batch_size", 12]


def export(snapshot, out, check=True, env=None):
    return run([PYTHON, EXPORT, snapshot, out], timeout=300, check=check, env=env)


def exported(snapshot):
    """export.py's single-file state of a sharded snapshot, made in this process."""
    return import_gpt_module("export").single_file_state(snapshot)


def assert_same_optimizer(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for key in a["state"]:
        assert_identical(a["state"][key], b["state"][key])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache):
    """20 steps on 2 processes under each strategy, global batch 24; snapshots as one process holds them."""
    out = {}
    for strategy in ("one", "ddp", "zero", "fsdp"):
        cwd = tmp_path_factory.mktemp(strategy)
        if strategy == "one":
            proc = train(cwd, cache, *STEPS, "--batch_size", 24)
        else:
            proc = train(cwd, cache, *STEPS, *ON_2, "--parallel", strategy, nproc=2)
        out[strategy] = (saved(cwd), proc.stdout)
        out[f"{strategy}_dir"] = cwd
    return out


def test_ddp_on_2_ranks_equals_one_process(runs):
    assert_close(runs["ddp"][0], runs["one"][0])


def test_zero_on_2_ranks_equals_ddp(runs):
    (ddp, _), (zero, log) = runs["ddp"], runs["zero"]
    assert "replicas identical: 2 copies" in log, log[-2000:]
    assert_identical(ddp["model"], zero["model"])  # each parameter is updated by the same AdamW arithmetic
    assert_same_optimizer(ddp["optimizer"], zero["optimizer"])  # each rank wrote its share; read whole
    assert_close(zero, runs["one"][0])


def test_fsdp_on_2_ranks_equals_ddp_and_keeps_the_tied_matrix_one(runs):
    (ddp, _), (fsdp, log) = runs["ddp"], runs["fsdp"]
    # no parameter is held by two processes: nothing to compare, and no full gather to do it
    assert "no weights are replicated across processes in this layout" in log, log[-2000:]
    assert fsdp["step"] == 20 and fsdp["model"].keys() == ddp["model"].keys()
    # the tied matrix stayed one parameter in training: AdamW state for the embedding, none for the head
    snapshot = runs["fsdp_dir"] / "gpt_snapshot"
    with open(next(snapshot.glob("step-*/.metadata")), "rb") as f:
        saved = import_gpt_module("snapshots.checkpoint").MetadataUnpickler(f).load().state_dict_metadata
    assert "optimizer.state.tok_emb.weight.exp_avg" in saved
    assert not [key for key in saved if key.startswith("optimizer.state.head.")], sorted(saved)
    print(f"fsdp vs ddp, 20 steps: max parameter difference {max_diff(ddp['model'], fsdp['model']):.3g}")
    assert max_diff(ddp["model"], fsdp["model"]) < 1e-4
    assert_close(fsdp, runs["one"][0])


@pytest.fixture(scope="module")
def crashed(tmp_path_factory, cache):
    """fsdp on 2 processes, process 0 killed while saving step 20: the snapshot of step 10 remains."""
    cwd = tmp_path_factory.mktemp("crashed")
    wrapper = PROGRAMS / "crash_at_save.py"
    proc = train(cwd, cache, *STEPS, *ON_2, "--parallel", "fsdp", nproc=2, script=wrapper, check=False)
    assert proc.returncode != 0, proc.stdout[-3000:]
    return cwd / "gpt_snapshot"


def test_a_crash_mid_save_leaves_the_previous_snapshot(crashed):
    steps = sorted(p.name for p in crashed.glob("step-*"))  # (hang/: the survivor's stack, lost its peer)
    assert [name[:13] for name in steps] == ["step-00000010", "step-00000020"], steps
    assert (crashed / "latest").read_text().strip() == steps[0]
    assert (crashed / steps[1] / ".metadata").exists()  # the new shards are all there, but not pointed at


@pytest.mark.parametrize(
    ("nproc", "args"), [(None, ["--batch_size", 24]), (3, ["--batch_size", 4, "--grad_accum", 2])]
)
def test_resume_on_another_number_of_processes(tmp_path, cache, crashed, runs, nproc, args):
    shutil.copytree(crashed, tmp_path / "gpt_snapshot")
    wrapper = PROGRAMS / "resave.py"
    proc = train(tmp_path, cache, *STEPS, *args, "--parallel", "fsdp", nproc=nproc, script=wrapper)
    assert "resuming" not in proc.stdout  # (train.py's message; the wrapper resumes silently)
    # the state as loaded by this many processes is the state 2 processes saved
    before, after = exported(tmp_path / "gpt_snapshot"), exported(tmp_path / "resaved")
    assert before["step"] == 20  # the resumed run went on to the end
    saved = exported(crashed)
    assert saved["step"] == after["step"] == 10
    assert_identical(saved["model"], after["model"])
    assert_same_optimizer(saved["optimizer"], after["optimizer"])
    assert len(after["rng"]) == (nproc or 1)
    # the partial step-20 directory is gone, replaced by the resumed run's own; step 10 kept (--keep 2)
    steps = sorted(p.name for p in (tmp_path / "gpt_snapshot").glob("step-*"))
    assert [name[:13] for name in steps] == ["step-00000010", "step-00000020"], steps
    assert steps[1] not in {p.name for p in crashed.iterdir()}
    diff = max_diff(runs["fsdp"][0]["model"], before["model"])
    print(f"fsdp 2 -> {nproc or 1} processes at step 10, then to 20: {diff:.3g} from the uninterrupted run")
    assert diff < 1e-4


def test_the_exported_file_resumes_as_a_single_file_snapshot(tmp_path, cache, crashed, runs):
    export(crashed, tmp_path / "gpt_snapshot.pt")
    # one process: --parallel zero is plain AdamW there, as the other strategies are
    args = ["--batch_size", 24, "--parallel", "zero", "--init_from", "gpt_snapshot.pt"]
    proc = train(tmp_path, cache, *STEPS, *args)
    assert "resuming from gpt_snapshot.pt at step 10" in proc.stdout, proc.stdout[-2000:]
    assert "1 process(es) on cpu" in proc.stdout
    assert max_diff(runs["fsdp"][0]["model"], saved(tmp_path)["model"]) < 1e-4


# ---- snapshots it cannot use: another model shape, files that would run code ---------------------------
def plant(kind, snapshot_dir, tmp_path):
    """A payload that would `touch pwned` when unpickled, in one file a load opens; that file's path."""
    step_dir = snapshot_dir / (snapshot_dir / "latest").read_text().strip()
    if kind == "other_config":  # no payload: a snapshot of a model with 2 layers, for a run with 3
        return step_dir / "extra.pt"
    if kind == "exported":
        state = exported(snapshot_dir)
        state["vocab"] = RunsCode()
        torch.save(state, tmp_path / "gpt_snapshot.pt")  # a real torch file with one object inside
        return tmp_path / "gpt_snapshot.pt"
    if kind == "linked":  # the step directory a symbolic link to a folder elsewhere on the machine
        step_dir.rename(tmp_path / "elsewhere")
        step_dir.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
        return tmp_path / "elsewhere" / "extra.pt"
    if kind == "extra":
        (step_dir / "extra.pt").write_bytes(pickle.dumps({"config": RunsCode()}))
        return step_dir / "extra.pt"
    if kind == "metadata":
        (step_dir / ".metadata").write_bytes(pickle.dumps(RunsCode()))
        return step_dir / ".metadata"
    if kind == "escaping":  # the data moved out of the folder, and .metadata naming it there
        with open(step_dir / ".metadata", "rb") as f:
            metadata = import_gpt_module("snapshots.checkpoint").MetadataUnpickler(f).load()
        for item in metadata.storage_data.values():
            outside = tmp_path / item.relative_path
            if not outside.exists():
                (step_dir / item.relative_path).rename(outside)
            item.relative_path = str(outside)  # absolute: DCP would read it, wherever it is
        (step_dir / ".metadata").write_bytes(pickle.dumps(metadata))
        return step_dir / ".metadata"
    # distcp: the same checkpoint written again by DCP itself, with one optimizer setting an object
    _, model, optimizer = import_gpt_module("export").load_whole(snapshot_dir)
    state = import_gpt_module("snapshots.checkpoint").flat_state(model, optimizer)
    lr = next(k for k in state if k.startswith("optimizer.param_groups.") and k.endswith(".lr"))
    state[lr] = RunsCode()
    for old in step_dir.glob("*.distcp"):
        old.unlink()
    planner = dcp.DefaultSavePlanner(flatten_state_dict=False)  # the trainer's flat keys, as it saves them
    dcp.save(state, checkpoint_id=step_dir, no_dist=True, planner=planner)
    data = next(step_dir.glob("*.distcp"))
    assert b"touch pwned" in data.read_bytes()
    return data


KINDS = ["other_config", "exported", "extra", "metadata", "distcp", "escaping", "linked"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_sharded_snapshot_it_cannot_use_is_refused_and_left_untouched(tmp_path, cache, crashed, kind):
    shutil.copytree(crashed, tmp_path / "gpt_snapshot")
    planted = plant(kind, tmp_path / "gpt_snapshot", tmp_path)
    if kind == "exported":  # a single file, imported into a new run
        shutil.rmtree(tmp_path / "gpt_snapshot")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert planted in before
    # torch.load's own default made unsafe: only the trainer's explicit choices stand in the way
    env = {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
    strategy = "ddp" if kind == "exported" else "fsdp"
    args = [
        *STEPS,
        "--parallel",
        strategy,
        "--batch_size",
        24,
        *(["--n_layer", 3] if kind == "other_config" else []),
        *(["--init_from", "gpt_snapshot.pt"] if kind == "exported" else []),
    ]
    procs = [train(tmp_path, cache, *args, check=False, env=env)]
    if kind in ("metadata", "distcp", "escaping", "linked"):
        procs.append(export(tmp_path / "gpt_snapshot", tmp_path / "out.pt", check=False, env=env))
    for proc in procs:
        assert proc.returncode == 1 and "Traceback" not in proc.stdout, proc.stdout[-3000:]
        assert "cannot resume from" in proc.stdout and "left untouched" in proc.stdout, proc.stdout[-2000:]
        assert kind != "other_config" or "another configuration: n_layer 2 (this run: 3)" in proc.stdout
        if kind in ("escaping", "linked"):
            assert "leaves the snapshot's folder" in proc.stdout, proc.stdout[-2000:]
    assert not (tmp_path / "pwned").exists()
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before  # nothing written


def test_export_refuses_a_snapshot_of_a_padded_vocabulary_and_says_why(tmp_path, crashed):
    """A snapshot written when every vocabulary was padded to a multiple of 64 (its config: 128 rows; the
    model of 96 characters now has 96) is refused by export.py with the reason, before DCP reads a shard
    (where a real one fails with a size mismatch, said as "cannot resume"). Only the config is changed
    here. Mutation: the check left out -> not refused, fails."""
    shutil.copytree(crashed, tmp_path / "gpt_snapshot")
    step_dir = tmp_path / "gpt_snapshot" / (tmp_path / "gpt_snapshot" / "latest").read_text().strip()
    extra = torch.load(step_dir / "extra.pt", weights_only=True)
    assert extra["config"]["padded_vocab"] == 96
    torch.save({**extra, "config": {**extra["config"], "padded_vocab": 128}}, step_dir / "extra.pt")
    export_mod = import_gpt_module("export")
    said = r"holds 128 vocabulary rows, this version's model 96 \(a vocabulary under 4096 tokens is no"
    with pytest.raises(export_mod.checkpoint.SnapshotError, match=said):
        export_mod.load_whole(tmp_path / "gpt_snapshot")


@pytest.mark.parametrize(
    "module, name",
    [
        ("torch", "load"),  # a callable in a module that is looked in
        ("torch.serialization", "os"),  # a module reached through one
        ("torch.distributed.checkpoint.filesystem", "FileSystemReader"),  # a class there, not a data record
        ("torch", "no_such_name"),
        ("os", "system"),
    ],
)
def test_metadata_may_name_only_data_records(module, name):
    payload = pickle.dumps(None, protocol=2).replace(b"N", f"c{module}\n{name}\n".encode(), 1)
    with pytest.raises(pickle.UnpicklingError, match="is not part of a checkpoint's metadata"):
        import_gpt_module("snapshots.checkpoint").MetadataUnpickler(io.BytesIO(payload)).load()


# ---- bad input ----------------------------------------------------------------------------------------
def test_comm_hook_with_fsdp_is_an_argparse_error(capsys):
    config = import_gpt_module("config")
    with pytest.raises(SystemExit) as exc:
        config.parse_args(["--parallel", "fsdp", "--comm_hook", "fp16"])
    assert exc.value.code == 2
    assert "--comm_hook is for DDP" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        ("bf16", "torch.bfloat16 torch.float32 torch.float32 torch.float32"),
        ("fp32", "torch.float32 torch.float32 torch.float32 torch.float32"),
    ],
)
def test_fsdp_bf16_gathers_bf16_reduces_and_keeps_float32(tmp_path, dtype, expected):
    """FSDP under bf16 gathers bf16 reduces float32 and keeps float32 shards.

    On 2 processes: a block computes with bf16 weights (gathered in bf16), its gradients are
    reduce-scattered in float32, and the shards and their gradients stay float32 (the master copy)."""
    cmd = [PYTHON, PROGRAMS / "fsdp_mixed_precision.py", EXAMPLES / "gpt", free_port(), dtype]
    proc = run(cmd, timeout=180, cwd=tmp_path, env=GPT_ON_PATH)
    assert f"RESULT {expected}" in proc.stdout, proc.stdout[-2000:]
