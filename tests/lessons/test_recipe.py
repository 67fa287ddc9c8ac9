"""examples/recipe.py, the DDP script to copy, and its accelerate twin examples/recipe_accelerate.py.

One bf16 run (2 processes, 2 loader workers each, 2 epochs) and one fp32 run are shared by the tests of this
file; each further launch checks one more claim. Every run is on the CPU (gloo), one thread a process.
"""

import argparse
import importlib.util
import random
import re
import runpy
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import EXAMPLES, SITES, bound, example_cmd, kill_group, load_snapshot, popen, run
from safetensors.torch import load_file

RECIPE = EXAMPLES / "recipe.py"
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
# 2 epochs of 22 steps a process: micro-batches of 16, two a step
COMMON = ["2", "1", "--batch_size", "16", "--grad_accum", "2"]
FP32 = [*COMMON, "--precision", "fp32", "--workers", "0"]
EPOCH_RE = re.compile(r"^epoch (\d+)/\d+ \| train_loss \S+ \| (val_loss (\S+) \| val_acc \d+/\d+ .*)$", re.M)
START_RE = re.compile(r"^(before epoch \d+|nothing to train) \| (val_loss \S+ \| val_acc \d+/\d+ .*)$", re.M)
# where a stop leaves the run, said on the stop and on the resume
PROGRESS = r"(\d) epochs already run(?:, and (\d+) steps of epoch \d)?"
STOPPED_RE = re.compile(
    rf"^stopped by SIGTERM, saved in recipe_snapshot.pt: the same command resumes, {PROGRESS}$", re.M
)


def launch(folder, nproc, *args, env=None):
    cmd = example_cmd("recipe", *args, nproc=nproc)
    return run(cmd, timeout=300, cwd=folder, env={**ONE_THREAD, **(env or {})}).stdout


def assert_same_snapshot(actual, expected, exact=True):
    """Bit for bit, or (exact=False) within float32's summation order after 44 AdamW steps: the weights to
    5e-6 (1.8e-6 measured; the loss not divided by --grad_accum: 3e-3), AdamW's moments to 1e-3 of each."""
    actual, expected = load_snapshot(actual), load_snapshot(expected)
    weights, moments = (
        ({"rtol": 0, "atol": 0},) * 2 if exact else ({"rtol": 0, "atol": 5e-6}, {"rtol": 1e-3, "atol": 1e-8})
    )
    torch.testing.assert_close(actual["MODEL_STATE"], expected["MODEL_STATE"], **weights)
    torch.testing.assert_close(actual["OPTIMIZER_STATE"], expected["OPTIMIZER_STATE"], **moments)
    if exact:
        assert actual["STATE"] == expected["STATE"]


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    """(folder, output) of the default precision (bf16 on a CPU), 2 loader workers a process."""
    folder = tmp_path_factory.mktemp("bf16")
    return folder, launch(folder, 2, *COMMON)


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    """(folder, output) in fp32 without loader workers, each DDP counting its gradient all-reduces."""
    folder = tmp_path_factory.mktemp("fp32")
    return folder, launch(folder, 2, *FP32, env={"PYTHONPATH": str(SITES / "count_allreduce")})


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_trains_and_keeps_the_best_snapshot_beside_the_last(bf16, fp32, precision):
    """Both precisions train (the validation loss falls by 2x, accuracy passes 60%); the folder holds the
    last snapshot and recipe_snapshot_best.pt, whose recorded loss is the lowest printed and whose step is
    that epoch's. Mutation: the best saved before self.best is updated -> its recorded loss is inf."""
    folder, out = {"bf16": bf16, "fp32": fp32}[precision]
    epochs = EPOCH_RE.findall(out)
    start = float(re.search(r"^before epoch 1 \| val_loss (\S+)", out, re.M).group(1))
    losses = [float(loss) for _, _, loss in epochs]
    assert [int(epoch) for epoch, _, _ in epochs] == [1, 2] and losses[-1] * 2 < start, out[-3000:]
    assert int(re.findall(r"val_acc (\d+)/359", out)[-1]) > 0.6 * 359
    assert sorted(p.name for p in folder.iterdir()) == ["recipe_snapshot.pt", "recipe_snapshot_best.pt"]
    best = load_snapshot(folder / "recipe_snapshot_best.pt")["STATE"]
    assert f"{best['best']:.6g}" == min(epochs, key=lambda e: float(e[2]))[2]
    assert (best["epochs"], best["steps"]) == (1 + losses.index(min(losses)), 0)


def test_sigterm_at_a_random_moment_then_a_rerun_ends_bit_for_bit(bf16, tmp_path):
    """SIGTERM at a random moment then the same command ends bit for bit.

    SIGTERM to torchrun at a random moment of a bf16 run with 2 loader workers a process: the
    processes agree to stop at the next step, rank 0 saves, one line names the snapshot and says the same
    command resumes, and running it again ends on the uninterrupted run's weights, optimizer state and
    printed lines, bit for bit, though it reads its batches without loader workers.
    Mutations: the skipped steps of a resumed epoch not read (`continue` before the batches are read) ->
    the epoch goes on from its first batches and the weights differ; the loader workers started without
    the signals held (no signals_held) -> one of them, started as SIGTERM came, dies of it ("DataLoader
    worker ... is killed by signal: Terminated") and the rank fails with a traceback (run it 10 times)."""
    cmd = example_cmd("recipe", *COMMON)
    proc = popen(
        cmd, cwd=tmp_path, env=ONE_THREAD, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        lines = []
        for line in proc.stdout:  # the signal handlers are set once training starts
            lines.append(line)
            if line.startswith("before epoch 1 |"):
                break
        delay = random.uniform(0, 0.5)  # within the run's 44 steps: at 2 s it had once ended (35 ms a step)
        time.sleep(delay)
        proc.send_signal(signal.SIGTERM)
        out = "".join(lines) + proc.communicate(timeout=bound(120))[0]
    finally:
        kill_group(proc)
    stopped = STOPPED_RE.findall(out)
    assert len(stopped) == 1 and "[rank0]: Traceback" not in out, f"after {delay:.2f} s:\n{out[-3000:]}"
    epochs, steps = stopped[0]
    assert 0 < 22 * int(epochs) + int(steps or 0) < 44, stopped  # a step of the run's 44
    resumed = launch(tmp_path, 2, *COMMON, "--workers", "0")  # augmented alike without loader processes
    said = STOPPED_RE.search(out).group(0).split("resumes, ")[1]
    assert f"resuming from recipe_snapshot.pt: {said}\n" in resumed, resumed[-3000:]
    folder, uninterrupted = bf16
    assert_same_snapshot(tmp_path / "recipe_snapshot.pt", folder / "recipe_snapshot.pt")
    done = [line for line in EPOCH_RE.findall(resumed)]
    assert done and done == EPOCH_RE.findall(uninterrupted)[-len(done) :], resumed[-3000:]


def test_validation_is_the_same_on_1_2_and_3_processes(bf16, tmp_path):
    """The bf16 run's last snapshot validated again on 1 and 3 processes (the same command finds every step
    done and only validates): loss and correct answers print exactly as the 2-process run printed them.
    359 images: 3 processes get 120 each, one a repeat, which the sums leave out. Mutations: the mean over
    each rank's batch means in place of the sums -> 3 processes print another loss; the repeats counted
    -> 3 processes print val_acc 322/360."""
    folder, out = bf16
    expected = EPOCH_RE.findall(out)[-1][1].rsplit(" | world_size", 1)[0]
    for nproc in (1, 3):
        shutil.copy(folder / "recipe_snapshot.pt", tmp_path)
        printed = START_RE.findall(launch(tmp_path, nproc, *COMMON, "--workers", "0"))  # no loader processes
        assert [(where, text.rsplit(" | world_size", 1)[0]) for where, text in printed] == [
            ("nothing to train", expected)
        ]
        assert printed[0][1].endswith(f"world_size {nproc}")


def test_a_run_stopped_mid_epoch_resumes_only_where_its_steps_are_the_same(bf16, tmp_path):
    """A snapshot taken 5 steps into epoch 2 by 2 processes of batch_size 16 x grad_accum 2, run again on one
    process: refused in one line that names both, the snapshot untouched (a step there is another slice of
    the epoch). A snapshot at an epoch's end resumes on any number: the test above. Mutation: the check
    left out -> the one process trains on from its own step 5 and overwrites the snapshot."""
    folder, _ = bf16
    snapshot = load_snapshot(folder / "recipe_snapshot.pt")
    snapshot["STATE"].update(epochs=1, steps=5)
    torch.save(snapshot, tmp_path / "recipe_snapshot.pt")
    before = (tmp_path / "recipe_snapshot.pt").read_bytes()
    cmd = example_cmd("recipe", *COMMON, "--workers", "0", nproc=1)
    proc = run(cmd, timeout=300, check=False, cwd=tmp_path, env=ONE_THREAD)
    said = "error: recipe_snapshot.pt stopped mid-epoch on 2 x 16 x 2 (processes x batch_size x grad_accum), "
    assert proc.returncode != 0 and f"{said}not 1 x 16 x 2: resume it so" in proc.stdout, proc.stdout[-3000:]
    assert (tmp_path / "recipe_snapshot.pt").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe_snapshot.pt"]


def test_fp32_accumulation_equals_the_large_batch_one_all_reduce(fp32, tmp_path):
    """fp32 accumulation equals the large batch with one all reduce a step.

    fp32, micro-batches of 16 two a step, against batches of 32 one a step: the same weights within 1e-6
    after 44 steps; and the accumulating run all-reduced gradients 44 times in each process (a communication
    hook counts them), not 88. Mutation: no_sync() removed -> 88 all-reduces (the weights still agree)."""
    folder, out = fp32
    assert sorted(re.findall(r"gradient all-reduces: (\d+) \(rank (\d)\)", out)) == [("44", "0"), ("44", "1")]
    large = [a if a != "16" else "32" for a in FP32]
    large[large.index("--grad_accum") + 1] = "1"
    launch(tmp_path, 2, *large)
    assert_same_snapshot(tmp_path / "recipe_snapshot.pt", folder / "recipe_snapshot.pt", exact=False)


def recipe_module():
    spec = importlib.util.spec_from_file_location("recipe", RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_image_is_augmented_alike_whatever_the_processes_and_workers():
    """An image's shift and noise come from the seed, the epoch and its index alone: 8 blank images read by
    one process without loader workers and by 2 ranks of 2 workers each come out the same, and differ from
    image to image and from epoch to epoch. So a resume with another number of workers or processes
    goes on as the run would have. Mutations: numpy's global random numbers (the old seeding) -> the
    two readings differ; the epoch left out of the seed -> the epochs are equal."""
    recipe = recipe_module()
    data = recipe.Augmented(torch.zeros(8, 1, 8, 8), torch.arange(8))

    def images(epoch, world, workers):
        data.epoch, by_index = epoch, {}
        for rank in range(world):
            sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank)
            loader = torch.utils.data.DataLoader(data, 1, sampler=sampler, num_workers=workers)
            by_index.update({int(index): image for image, index in loader})
        return torch.cat([by_index[index] for index in range(8)])

    alone = images(0, 1, 0)
    assert torch.equal(images(0, 2, 2), alone)
    assert not torch.equal(alone[0], alone[1]), "two images alike"
    assert not torch.equal(images(1, 1, 0), alone), "two epochs alike"


def test_a_resume_moves_the_model_before_it_loads_the_optimizer_state(tmp_path):
    """On a GPU, load_snapshot moves the model to its device before it loads the optimizer's state, which
    torch puts beside each parameter; loaded first, AdamW's state would stay on the CPU and the first step
    would mix devices. Without a GPU the order of the two is what the test can see (make gpu-check resumes
    on CUDA). Mutation: the model moved after the load (DDP(model.to(device)), as it once was) -> fails."""
    recipe = recipe_module()
    args = argparse.Namespace(seed=0, lr=0.01)
    model, optimizer = recipe.load_train_objs(args)[2:]
    model(torch.zeros(2, 1, 8, 8)).sum().backward()
    optimizer.step()  # AdamW's moments now exist
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    recipe.save_snapshot(tmp_path / "s.pt", model, optimizer, scaler, {"epochs": 1})
    model, optimizer = recipe.load_train_objs(args)[2:]
    done, to, load = [], model.to, optimizer.load_state_dict
    model.to = lambda device: done.append(f"model to {device}") or to(device)
    optimizer.load_state_dict = lambda state: done.append("optimizer state loaded") or load(state)
    recipe.load_snapshot(tmp_path / "s.pt", model, optimizer, scaler, torch.device("cpu"))
    assert done == ["model to cpu", "optimizer state loaded"], done
    assert len(optimizer.state) == len(list(model.parameters()))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["1", "1", "--lr", "nan"], "lr must be positive and finite, got nan"),
        (["1", "1", "--lr", "inf"], "lr must be positive and finite, got inf"),
        (["1", "1", "--grad_accum", "0"], "grad_accum must be positive and finite, got 0"),
        (["1", "1", "--workers", "-1"], "workers must be 0 or more, got -1"),
        (["1", "1", "--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
        (["1", "1", "--timeout", "nan"], "timeout must be positive and finite, got nan"),
        (["1", "1", "--seed", "-1"], "seed must be 0 or more, got -1"),
        (["1", "1", "--snapshot_path", "no/s.pt"], "snapshot_path: no folder no to write in; create it"),
    ],
)
@pytest.mark.parametrize("script", ["recipe", "recipe_accelerate"])
def test_bad_input_is_refused_with_exit_2(tmp_path, monkeypatch, capsys, script, args, message):
    """Said once, exit status 2, no traceback, nothing written: the lessons' refuse() (under torchrun, said
    once in its summary), before any training (a missing snapshot folder too, not at the first save).
    Mutation: the check `0 < value < inf` written `value > 0` -> --lr inf passes it and the run goes on to
    need a process group: a traceback, not exit 2."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / f"{script}.py"), *args])

    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(EXAMPLES / f"{script}.py"), run_name="__main__")
    out = capsys.readouterr()
    assert exited.value.code == 2 and out.err.count(message) == 1 and "Traceback" not in out.err, out
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("script", ["recipe", "recipe_accelerate"])
def test_without_torchrun_help_is_whole_and_a_run_says_how_to_start(monkeypatch, capsys, script):
    """`python recipe.py --help` prints every option; `python recipe.py 10 5` prints argparse's whole usage
    line and how to start it, exit status 2. Mutation: the torchrun check before the options are added
    (as the lessons do) -> --help shows --timeout alone."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    path = str(EXAMPLES / f"{script}.py")
    for args, code in [(["--help"], 0), (["10", "5"], 2)]:
        monkeypatch.setattr(sys, "argv", [path, *args])
        try:
            runpy.run_path(path, run_name="__main__")
            ended = 0  # @record ends an exit status of 0 quietly
        except SystemExit as exited:
            ended = exited.code
        out = capsys.readouterr()
        assert ended == code and "--snapshot_path" in out.out + out.err, out
    assert out.err.rstrip().endswith(
        f"{script}.py: error: start me with torchrun --standalone --nproc-per-node=2 {path} ..."
    ), out.err


def test_the_accelerate_twin_ends_where_the_ddp_recipe_ends(fp32, tmp_path):
    """recipe_accelerate.py under `accelerate launch` with the committed one_node.yaml (2 processes), fp32,
    the same arguments: the same printed validation loss and weights within 1e-6 of the DDP recipe's. Run
    again with the snapshot left as PATH.tmp (a save cut short after it was whole), it resumes from it.
    Mutation: `with accelerator.accumulate(model):` left out -> the optimizer steps at every micro-batch
    and the weights differ."""
    cmd = example_cmd("recipe_accelerate", *FP32)
    out = run(cmd, timeout=300, cwd=tmp_path, env=ONE_THREAD).stdout
    folder, expected = fp32
    assert EPOCH_RE.findall(out)[-1][2] == EPOCH_RE.findall(expected)[-1][2], out[-3000:]
    model = load_file(tmp_path / "recipe_accelerate_snapshot" / "model.safetensors")
    for key, tensor in load_snapshot(folder / "recipe_snapshot.pt")["MODEL_STATE"].items():
        torch.testing.assert_close(model[key], tensor, rtol=0, atol=1e-6)
    # a save that ended between removing the old snapshot and moving the new one in: it is taken
    snapshot = tmp_path / "recipe_accelerate_snapshot"
    snapshot.rename(f"{snapshot}.tmp")
    again = run(cmd, timeout=300, cwd=tmp_path, env=ONE_THREAD).stdout
    assert "resuming from recipe_accelerate_snapshot: 2 epochs already run" in again, again[-3000:]
    assert "nothing to train | " in again and snapshot.is_dir(), again[-3000:]
