"""examples/recipe.py, the DDP script to copy, and its accelerate twin examples/recipe_accelerate.py.

One bf16 run (2 processes, 2 loader workers each, 2 epochs) and one fp32 run are shared by the tests of this
file; each further launch checks one more claim. Every run is on the CPU (gloo), one thread a process.
"""

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
START_RE = re.compile(r"^step (\d+) \| (val_loss \S+ \| val_acc \d+/\d+ .*)$", re.M)
STOPPED = "stopped by SIGTERM at step {}, saved in recipe_snapshot.pt: the same command resumes"


def launch(folder, nproc, *args, env=None):
    cmd = example_cmd("recipe", *args, nproc=nproc)
    return run(cmd, timeout=300, cwd=folder, env={**ONE_THREAD, **(env or {})}).stdout


def assert_same_snapshot(actual, expected, exact=True):
    actual, expected = load_snapshot(actual), load_snapshot(expected)
    tolerance = {"rtol": 0, "atol": 0} if exact else {"rtol": 0, "atol": 1e-6}
    torch.testing.assert_close(actual["MODEL_STATE"], expected["MODEL_STATE"], **tolerance)
    if exact:
        torch.testing.assert_close(actual["OPTIMIZER_STATE"], expected["OPTIMIZER_STATE"], rtol=0, atol=0)
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
    start = float(re.search(r"^step 0 \| val_loss (\S+)", out, re.M).group(1))
    losses = [float(loss) for _, _, loss in epochs]
    assert [int(epoch) for epoch, _, _ in epochs] == [1, 2] and losses[-1] * 2 < start, out[-3000:]
    assert int(re.findall(r"val_acc (\d+)/359", out)[-1]) > 0.6 * 359
    assert sorted(p.name for p in folder.iterdir()) == ["recipe_snapshot.pt", "recipe_snapshot_best.pt"]
    best = load_snapshot(folder / "recipe_snapshot_best.pt")["STATE"]
    assert f"{best[1]:.6g}" == min(epochs, key=lambda e: float(e[2]))[2]
    assert best[0] == 22 * (1 + losses.index(min(losses)))


def test_sigterm_at_a_random_moment_then_a_rerun_ends_bit_for_bit(bf16, tmp_path):
    """SIGTERM at a random moment then the same command ends bit for bit.

    SIGTERM to torchrun at a random moment of a bf16 run with 2 loader workers a process: the
    processes agree to stop at the next step, rank 0 saves, one line names the snapshot and says the same
    command resumes, and running it again ends on the uninterrupted run's weights, optimizer state and
    printed lines, bit for bit.
    Mutations: the skipped steps of a resumed epoch not read again (`continue` before the batches are
    read) -> the augmentations shift and the weights differ; the loader workers not blocking the signal
    (no quiet_worker) -> a worker dies of it, "DataLoader worker ... is killed by signal: Terminated", and
    the rank fails with a traceback."""
    cmd = example_cmd("recipe", *COMMON)
    proc = popen(
        cmd, cwd=tmp_path, env=ONE_THREAD, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        lines = []
        for line in proc.stdout:  # the signal handlers are set once training starts
            lines.append(line)
            if line.startswith("step 0 |"):
                break
        delay = random.uniform(0, 0.5)  # within the run's 44 steps: at 2 s it had once ended (35 ms a step)
        time.sleep(delay)
        proc.send_signal(signal.SIGTERM)
        out = "".join(lines) + proc.communicate(timeout=bound(120))[0]
    finally:
        kill_group(proc)
    stopped = re.findall(r"^stopped by SIGTERM at step (\d+), .*$", out, re.M)
    assert len(stopped) == 1 and 0 < int(stopped[0]) < 44, f"after {delay:.2f} s:\n{out[-3000:]}"
    assert STOPPED.format(stopped[0]) in out and "[rank0]: Traceback" not in out, out[-3000:]
    resumed = launch(tmp_path, 2, *COMMON)
    assert f"resuming from recipe_snapshot.pt: {stopped[0]} steps already run" in resumed
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
        assert [(step, text.rsplit(" | world_size", 1)[0]) for step, text in printed] == [("44", expected)]
        assert printed[0][1].endswith(f"world_size {nproc}")


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


def test_augmentations_differ_by_rank_worker_epoch_and_repeat():
    """Augmentations differ by rank worker and epoch and repeat in every run.

    The recipe's Augmented data set of 8 identical blank images, read by 2 workers a rank with the
    recipe's seeding, one image a batch: the noise differs between the two workers, the two ranks and two
    epochs, and a second run gives the same images. Mutations: the rank left out of seed_epoch's seed ->
    both ranks' images are equal; no generator set -> the second run differs."""
    recipe = recipe_module()
    data = recipe.Augmented(torch.zeros(8, 1, 8, 8), torch.zeros(8, dtype=torch.long))

    def images(rank, epoch):
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=rank)
        loader = torch.utils.data.DataLoader(
            data, 1, sampler=sampler, num_workers=2, worker_init_fn=recipe.quiet_worker
        )
        recipe.seed_epoch(loader, 0, epoch, rank, 2)
        return torch.cat([image for image, _ in loader])

    first = {(rank, epoch): images(rank, epoch) for rank in (0, 1) for epoch in (0, 1)}
    batch = first[0, 0]
    assert not torch.equal(batch[0], batch[1]), "worker 0's first image and worker 1's"
    assert not torch.equal(first[0, 0], first[1, 0]) and not torch.equal(first[0, 0], first[0, 1])
    assert all(torch.equal(images(*key), value) for key, value in first.items())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["1", "1", "--lr", "nan"], "lr must be positive and finite, got nan"),
        (["1", "1", "--lr", "inf"], "lr must be positive and finite, got inf"),
        (["1", "1", "--grad_accum", "0"], "grad_accum must be positive and finite, got 0"),
        (["1", "1", "--workers", "-1"], "workers must be 0 or more, got -1"),
        (["1", "1", "--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
    ],
)
def test_bad_input_is_refused_with_exit_2(tmp_path, monkeypatch, capsys, args, message):
    """Said once, exit status 2, no traceback, nothing written: the lessons' refuse() (under torchrun, said
    once in its summary). Mutation: the check `0 < value < inf` written `value > 0` -> --lr inf passes it
    and the run goes on to need a process group: a traceback, not exit 2."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.setattr(sys, "argv", [str(RECIPE), *args])

    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(RECIPE), run_name="__main__")
    out = capsys.readouterr()
    assert exited.value.code == 2 and out.err.count(message) == 1 and "Traceback" not in out.err, out
    assert not list(tmp_path.iterdir())


def test_the_accelerate_twin_ends_where_the_ddp_recipe_ends(fp32, tmp_path):
    """recipe_accelerate.py under `accelerate launch` with the committed one_node.yaml (2 processes), fp32,
    the same arguments: the same printed validation loss and weights within 1e-6 of the DDP recipe's.
    Mutation: `with accelerator.accumulate(model):` left out -> the optimizer steps at every micro-batch
    and the weights differ."""
    cmd = example_cmd("recipe_accelerate", *FP32)
    out = run(cmd, timeout=300, cwd=tmp_path, env=ONE_THREAD).stdout
    folder, expected = fp32
    assert EPOCH_RE.findall(out)[-1][2] == EPOCH_RE.findall(expected)[-1][2], out[-3000:]
    model = load_file(tmp_path / "recipe_accelerate_snapshot" / "model.safetensors")
    for key, tensor in load_snapshot(folder / "recipe_snapshot.pt")["MODEL_STATE"].items():
        torch.testing.assert_close(model[key], tensor, rtol=0, atol=1e-6)
