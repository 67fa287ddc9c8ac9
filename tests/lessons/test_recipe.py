"""examples/recipe.py, the DDP script to copy, and its accelerate twin examples/recipe_accelerate.py.

One fp16 run (2 processes, 2 loader workers each, 2 epochs: the loss scaler, clipping the unscaled gradients,
the warm-up) and one fp32 run are shared by the tests of this file; each further launch checks one more
claim. Every run is on the CPU (gloo; fp16 by torch's CPU autocast and GradScaler), one thread a process;
torchrun starts the runs whose subject it is part of (a signal, a refusal in its summary), the rest fork.
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
from helpers import (
    EXAMPLES,
    FORKRUN,
    PYTHON,
    SITES,
    bound,
    example_cmd,
    kill_group,
    load_snapshot,
    popen,
    run,
)
from safetensors.torch import load_file

RECIPE = EXAMPLES / "recipe.py"
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
# 2 epochs of 22 steps a process: micro-batches of 16, two a step
COMMON = ["2", "1", "--batch_size", "16", "--grad_accum", "2"]
FP16 = [*COMMON, "--precision", "fp16"]
FP32 = [*COMMON, "--precision", "fp32", "--workers", "0"]
STEP_RE = re.compile(r"^step (\d+)/(\d+) of epoch (\d+) \| loss \S+ \| lr \S+$", re.M)
EPOCH_RE = re.compile(r"^epoch (\d+)/\d+ \| train_loss \S+ \| (val_loss (\S+) \| val_acc \d+/\d+ .*)$", re.M)
START_RE = re.compile(r"^(before epoch \d+|nothing to train) \| (val_loss \S+ \| val_acc \d+/\d+ .*)$", re.M)
# where a stop leaves the run, said on the stop and on the resume
PROGRESS = r"(\d) epochs already run(?:, and (\d+) steps of epoch \d)?"
STOPPED_RE = re.compile(
    rf"^stopped by SIGTERM, saved in recipe_snapshot.pt: the same command resumes, {PROGRESS}$", re.M
)


def launch(folder, nproc, *args, env=None, torchrun=False):
    """recipe.py's output on nproc processes forked from one that imported torch (FORKRUN: one import of
    torch, not nproc + 1), or under torchrun where its part is tested (atexit handlers run there)."""
    cmd = (
        example_cmd("recipe", *args, nproc=nproc)
        if torchrun
        else [*FORKRUN, f"--nproc-per-node={nproc}", RECIPE, *args]
    )
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
def fp16(tmp_path_factory):
    """(folder, output) in fp16 with its loss scaler, 2 loader workers a process."""
    folder = tmp_path_factory.mktemp("fp16")
    return folder, launch(folder, 2, *FP16)


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    """(folder, output) in fp32 without loader workers, each DDP counting its gradient all-reduces."""
    folder = tmp_path_factory.mktemp("fp32")
    return folder, launch(folder, 2, *FP32, env={"PYTHONPATH": str(SITES / "count_allreduce")}, torchrun=True)


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_trains_and_keeps_the_best_snapshot_beside_the_last(fp16, fp32, precision):
    """Both precisions train (the validation loss falls by 2x, accuracy passes 60%), with a log line every
    10 steps and at each epoch's end; the folder holds the last snapshot and recipe_snapshot_best.pt, whose
    recorded loss is the lowest printed and whose step is that epoch's. Mutation: the best saved before
    self.best is updated -> its recorded loss is inf. (fp16's gradients clipped before they are unscaled
    trains too: AdamW's step hardly depends on the gradients' scale; no test here tells them apart.)"""
    folder, out = {"fp16": fp16, "fp32": fp32}[precision]
    logged = [(int(step), int(epoch)) for step, total, epoch in STEP_RE.findall(out) if total == "22"]
    assert logged == [(10, 1), (20, 1), (22, 1), (10, 2), (20, 2), (22, 2)], out[-3000:]
    epochs = EPOCH_RE.findall(out)
    start = float(re.search(r"^before epoch 1 \| val_loss (\S+)", out, re.M).group(1))
    losses = [float(loss) for _, _, loss in epochs]
    assert [int(epoch) for epoch, _, _ in epochs] == [1, 2] and losses[-1] * 2 < start, out[-3000:]
    assert int(re.findall(r"val_acc (\d+)/359", out)[-1]) > 0.6 * 359
    assert sorted(p.name for p in folder.iterdir()) == ["recipe_snapshot.pt", "recipe_snapshot_best.pt"]
    best = load_snapshot(folder / "recipe_snapshot_best.pt")["STATE"]
    assert f"{best['best']:.6g}" == min(epochs, key=lambda e: float(e[2]))[2]
    assert (best["epochs"], best["steps"]) == (1 + losses.index(min(losses)), 0)


def test_sigterm_at_a_random_moment_then_a_rerun_ends_bit_for_bit(fp16, tmp_path):
    """SIGTERM at a random moment then the same command ends bit for bit.

    SIGTERM to torchrun at a random moment of an fp16 run with 2 loader workers a process: the
    processes agree to stop at the next log line, rank 0 saves, one line names the snapshot and says the
    same command resumes, and running it again ends on the uninterrupted run's weights, optimizer state,
    loss scale and printed lines (their learning rates too), bit for bit, though it reads its batches
    without loader workers. Mutations: the resumed epoch read from its start (`list(self.sampler)` not
    sliced) -> the weights differ; the scheduler's state not loaded -> the learning rates differ; the
    loader workers started without the signals held (no signals_held) -> one of them, started as SIGTERM
    came, dies of it ("DataLoader worker ... is killed by signal: Terminated") and the rank fails with a
    traceback (run it 10 times)."""
    cmd = example_cmd("recipe", *FP16)
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
    resumed = launch(tmp_path, 2, *FP16, "--workers", "0")  # augmented alike without loader processes
    said = STOPPED_RE.search(out).group(0).split("resumes, ")[1]
    assert f"resuming from recipe_snapshot.pt: {said}\n" in resumed, resumed[-3000:]
    folder, uninterrupted = fp16
    assert_same_snapshot(tmp_path / "recipe_snapshot.pt", folder / "recipe_snapshot.pt")
    done = [line for line in EPOCH_RE.findall(resumed)]
    assert done and done == EPOCH_RE.findall(uninterrupted)[-len(done) :], resumed[-3000:]


def test_validation_is_the_same_on_1_2_and_3_processes(fp16, tmp_path):
    """The fp16 run's last snapshot validated again on 1 and 3 processes (the same command finds every step
    done and only validates): loss and correct answers print exactly as the 2-process run printed them.
    359 images: 3 processes get 120, 120 and 119, none repeated. Mutations: the mean over each rank's
    batch means in place of the sums -> 3 processes print another loss; each process given the images
    from its rank on (`range(rank, 359)`) -> val_acc counts more than 359."""
    folder, out = fp16
    expected = EPOCH_RE.findall(out)[-1][1].rsplit(" | world_size", 1)[0]
    for nproc in (1, 3):
        shutil.copy(folder / "recipe_snapshot.pt", tmp_path)
        printed = START_RE.findall(launch(tmp_path, nproc, *FP16, "--workers", "0"))  # no loader processes
        assert [(where, text.rsplit(" | world_size", 1)[0]) for where, text in printed] == [
            ("nothing to train", expected)
        ]
        assert printed[0][1].endswith(f"world_size {nproc}")


def test_a_run_stopped_mid_epoch_resumes_only_where_its_steps_are_the_same(fp16, tmp_path):
    """A snapshot taken 5 steps into epoch 2 by 2 processes of batch_size 16 x grad_accum 2, run again on one
    process: refused in one line that names both, the snapshot untouched (a step there is another slice of
    the epoch). A snapshot at an epoch's end resumes on any number: the test above. Mutation: the check
    left out -> the one process trains on from its own step 5 and overwrites the snapshot."""
    folder, _ = fp16
    snapshot = load_snapshot(folder / "recipe_snapshot.pt")
    snapshot["STATE"].update(epochs=1, steps=5)
    torch.save(snapshot, tmp_path / "recipe_snapshot.pt")
    before = (tmp_path / "recipe_snapshot.pt").read_bytes()
    cmd = example_cmd("recipe", *FP16, "--workers", "0", nproc=1)
    proc = run(cmd, timeout=300, check=False, cwd=tmp_path, env=ONE_THREAD)
    said = "error: recipe_snapshot.pt stopped mid-epoch on [2, 16, 2], not [1, 16, 2] (processes, batch_size,"
    assert proc.returncode != 0 and f"{said} grad_accum): resume it so" in proc.stdout, proc.stdout[-3000:]
    assert (tmp_path / "recipe_snapshot.pt").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe_snapshot.pt"]


def test_fp32_accumulation_equals_the_large_batch_one_all_reduce(fp32, tmp_path):
    """fp32 accumulation equals the large batch with one all reduce a step.

    fp32, micro-batches of 16 two a step, against batches of 32 one a step: the same weights within 1e-6
    after 44 steps; and the accumulating run all-reduced gradients 44 times in each process (a communication
    hook counts them), not 88. Mutation: no_sync() removed -> 88 all-reduces (the weights still agree).
    The large batches' run is compiled (--compile): inductor writes its kernels in the run's cache folder,
    and the weights stay within the bound. Mutation: --compile ignored -> no kernels: fails."""
    folder, out = fp32
    assert sorted(re.findall(r"gradient all-reduces: (\d+) \(rank (\d)\)", out)) == [("44", "0"), ("44", "1")]
    large = [a if a != "16" else "32" for a in FP32]
    large[large.index("--grad_accum") + 1] = "1"
    launch(tmp_path, 2, *large, "--compile", env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    assert list((tmp_path / "inductor").rglob("*.so")), "no compiled kernel"
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
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    recipe.save_snapshot(tmp_path / "s.pt", model, optimizer, scaler, scheduler, {"epochs": 1})
    model, optimizer = recipe.load_train_objs(args)[2:]
    done, to, load = [], model.to, optimizer.load_state_dict
    model.to = lambda device: done.append(f"model to {device}") or to(device)
    optimizer.load_state_dict = lambda state: done.append("optimizer state loaded") or load(state)
    recipe.load_snapshot(tmp_path / "s.pt", model, optimizer, scaler, scheduler, torch.device("cpu"))
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
        (["1", "1", "--log_every", "0"], "log_every must be positive and finite, got 0"),
        (["1", "1", "--clip", "-1"], "clip must be 0 or more, got -1.0"),
        (["1", "1", "--save_steps", "15"], "save_steps must be a multiple of log_every (10)"),
        (["1", "1", "--batchsize", "8"], "arguments: --batchsize 8 (did you mean --batch_size?)"),
        (["1", "1", "--lr=1", "--nosuch"], "unrecognized arguments: --nosuch\n"),
    ],
)
@pytest.mark.parametrize("script", ["recipe", "recipe_accelerate"])
def test_bad_input_is_refused_with_exit_2(tmp_path, monkeypatch, capsys, script, args, message):
    """Said once, exit status 2, no traceback, nothing written: the lessons' refuse() (under torchrun, said
    once in its summary), before any training (a missing snapshot folder too, not at the first save); a
    misspelt option names the nearest. Mutation: the suggestion left out -> the typo's case fails.
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


def test_the_twin_refuses_fp16_on_the_cpu(tmp_path, monkeypatch, capsys):
    """accelerate turns fp16's autocast and loss scaler on off the CPU only: asked for fp16 on the CPU, the
    twin says so (exit status 2) rather than train in fp32 without a word."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        sys, "argv", [str(EXAMPLES / "recipe_accelerate.py"), "1", "1", "--precision", "fp16"]
    )
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(EXAMPLES / "recipe_accelerate.py"), run_name="__main__")
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "error: --precision fp16 needs a GPU" in err, err


@pytest.mark.parametrize("script", ["recipe", "recipe_accelerate"])
def test_without_torchrun_help_is_whole_and_a_run_says_how_to_start(monkeypatch, capsys, script):
    """`python recipe.py --help` prints every option; `python recipe.py 10 5` prints argparse's whole usage
    line and how to start it, exit status 2 (the twin, as accelerate's scripts, trains alone: the test
    below). Mutation: the torchrun check before the options are added (as the lessons do) -> --help shows
    --timeout alone."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    path = str(EXAMPLES / f"{script}.py")
    for args, code in [(["--help"], 0), (["10", "5"], 2)][: 1 if script == "recipe_accelerate" else 2]:
        monkeypatch.setattr(sys, "argv", [path, *args])
        try:
            runpy.run_path(path, run_name="__main__")
            ended = 0  # @record ends an exit status of 0 quietly
        except SystemExit as exited:
            ended = exited.code
        out = capsys.readouterr()
        assert ended == code and "--snapshot_path" in out.out + out.err, out
    if script == "recipe":
        assert out.err.rstrip().endswith(
            f"{script}.py: error: start me with torchrun --standalone --nproc-per-node=2 {path} ..."
        ), out.err


def test_on_one_process_the_twin_prints_and_ends_as_recipe_py(tmp_path):
    """On one process, in the default bf16, with clipping at 0.1 (it acts at every step): recipe.py under
    torchrun and the twin under `accelerate launch --num_processes 1 --cpu` (which runs it as plain python)
    print the same lines and end on the same weights, bit for bit: both shuffle by torch's permutation of
    seed + epoch. (On 2 processes accelerate deals whole batches where DistributedSampler deals samples:
    the twin's own test below.) With --save_steps 10, a snapshot of step 10 or 20 of epoch 1 is on disk
    once recipe.py has logged step 20. The twin with --compile writes inductor's kernels. Mutations:
    recipe.py's clipping left out -> the weights differ; the twin's `accelerator.accumulate` left out ->
    it steps at every micro-batch: the lines differ; --save_steps ignored -> no snapshot there; the twin's
    --compile ignored -> no kernels."""
    args = ["1", "1", "--batch_size", "16", "--grad_accum", "2", "--clip", "0.1", "--workers", "0"]
    cmd = example_cmd("recipe", *args, "--save_steps", "10", nproc=1)
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    proc = popen(cmd, cwd=tmp_path, env=ONE_THREAD, **pipes)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step 20/44 of epoch 1 |"):
                shutil.copy(tmp_path / "recipe_snapshot.pt", tmp_path / "mid.pt")
        proc.wait(timeout=bound(120))
    finally:
        kill_group(proc)
    assert proc.returncode == 0, "".join(lines)[-3000:]
    assert load_snapshot(tmp_path / "mid.pt")["STATE"]["steps"] in (10, 20)
    launcher = [PYTHON, "-m", "accelerate.commands.launch", "--num_processes", "1", "--cpu"]
    twin = run([*launcher, EXAMPLES / "recipe_accelerate.py", *args, "--precision", "bf16"], timeout=300,
               cwd=tmp_path, env=ONE_THREAD).stdout  # fmt: skip
    ours = "".join(lines)
    assert STEP_RE.findall(twin) == STEP_RE.findall(ours) and len(STEP_RE.findall(ours)) == 5, twin[-3000:]
    assert EPOCH_RE.findall(twin) == EPOCH_RE.findall(ours), twin[-3000:]
    model = load_file(tmp_path / "recipe_accelerate_snapshot" / "model.safetensors")
    torch.testing.assert_close(
        model, load_snapshot(tmp_path / "recipe_snapshot.pt")["MODEL_STATE"], rtol=0, atol=0
    )
    # --compile: accelerate's dynamo_backend, whose kernels inductor writes in the run's cache folder
    compiled = [*launcher, EXAMPLES / "recipe_accelerate.py", "1", "1", "--batch_size", "256", "--compile"]
    compiled += ["--workers", "0", "--snapshot_path", "compiled"]
    cache = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), **ONE_THREAD}
    assert "epoch 1/1 | " in run(compiled, timeout=300, cwd=tmp_path, env=cache).stdout
    assert list((tmp_path / "inductor").rglob("*.so")), "no compiled kernel"


def test_the_twin_stopped_on_2_processes_resumes_under_torchrun_bit_for_bit(tmp_path):
    """The twin under `accelerate launch` with the committed one_node.yaml (2 processes, fp32) trains (the
    validation loss halves). Run again, SIGTERM as it starts: it stops at a log line of epoch 1, saves,
    and the same arguments under torchrun resume from it mid-epoch (skip_first_batches) and end on the
    uninterrupted run's weights and lines, bit for bit; the snapshot left as PATH.tmp (a save cut short
    after it was whole) is taken. Mutation: skip_first_batches given 0 -> the resumed epoch starts again
    from its first batches and the weights differ."""
    runs = ("whole", "stopped")
    for name in runs:
        (tmp_path / name).mkdir()
    cmd = example_cmd("recipe_accelerate", *FP32)
    whole = run(cmd, timeout=300, cwd=tmp_path / "whole", env=ONE_THREAD).stdout
    start = float(re.search(r"^before epoch 1 \| val_loss (\S+)", whole, re.M).group(1))
    assert float(EPOCH_RE.findall(whole)[-1][2]) * 2 < start, whole[-3000:]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    proc = popen([*cmd, "--workers", "2"], cwd=tmp_path / "stopped", env=ONE_THREAD, **pipes)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("before epoch 1 |"):  # the signal handlers are set
                proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=bound(120))
    finally:
        kill_group(proc)
    stopped = "".join(lines)
    assert "stopped by SIGTERM, saved in recipe_accelerate_snapshot" in stopped, stopped[-3000:]
    snapshot = tmp_path / "stopped" / "recipe_accelerate_snapshot"
    snapshot.rename(f"{snapshot}.tmp")
    torchrun = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    script = [*torchrun, EXAMPLES / "recipe_accelerate.py", *FP32]
    resumed = run(script, timeout=300, cwd=tmp_path / "stopped", env=ONE_THREAD).stdout
    said = re.search(
        r"resuming from recipe_accelerate_snapshot: 0 epochs already run, and (\d+) steps", resumed
    )
    assert said and said.group(1) in ("10", "20"), resumed[-3000:]
    assert EPOCH_RE.findall(resumed) == EPOCH_RE.findall(whole), resumed[-3000:]
    ends = [load_file(tmp_path / name / "recipe_accelerate_snapshot" / "model.safetensors") for name in runs]
    torch.testing.assert_close(ends[0], ends[1], rtol=0, atol=0)
