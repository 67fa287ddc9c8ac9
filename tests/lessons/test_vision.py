"""The vision workload: ResNet-18 on synthetic images."""

from helpers import EXAMPLES, PYTHON, TORCHRUN, TrainLog, example_cmd, load_snapshot, run

TINY = ["--batch_size", "4", "--momentum", "0.9"]


def test_trains_on_synthetic_images(tmp_path):
    """ResNet-18 on synthetic images trains: the loss halves in 3 epochs. Over a minute: 96 steps of
    ResNet-18 on 2 cores, the fewest in which its loss halves (65 s in a whole run)."""
    cmd = example_cmd("single_gpu", 3, 3, *TINY, "--dataset_size", "128", vision=True)
    log = TrainLog(run(cmd, timeout=600, cwd=tmp_path).stdout)  # ResNet-18 on 32x32 images: 96 steps
    assert log.epochs == [1, 2, 3]
    # each class is a pattern plus noise, so there is something to learn and the loss falls
    assert log.losses[-1] < log.losses[0] / 2, log.losses
    assert load_snapshot(tmp_path / "single_gpu_snapshot.pt")["MODEL_STATE"]["fc.weight"].shape == (10, 512)


def test_without_a_lesson_it_says_how_to_call_it(tmp_path):
    """Without a lesson it says how to call it and the lesson's own checks still hold.

    vision.py names its missing argument (exit 2); given a lesson, bad input meets the lesson's own
    argparse, under the lesson's name; neither leaves a file. Mutation: sys.argv left as it came, with
    vision.py first, so that the lesson is not what runs: this fails."""
    alone = run([PYTHON, EXAMPLES / "vision.py"], timeout=60, check=False, cwd=tmp_path)
    assert alone.returncode == 2 and "error: name a lesson's file first" in alone.stdout, alone.stdout
    bad = run([PYTHON, EXAMPLES / "vision.py", EXAMPLES / "single_gpu.py", 0, 1], timeout=120, check=False,
              cwd=tmp_path)  # fmt: skip
    assert bad.returncode == 2, bad.stdout
    assert "single_gpu.py: error: total_epochs must be positive and finite, got 0" in bad.stdout, bad.stdout
    assert not list(tmp_path.iterdir())


def test_sync_bn_on_the_cpu_is_refused_before_any_work(tmp_path):
    """SyncBatchNorm runs on GPUs only (tests/repo/test_gpu.py trains with it): on the CPU --sync_bn is
    refused at once, exit 2, nothing written. Mutation: no such check: every process fails in its first
    forward with a traceback, exit 1, and this fails."""
    cmd = example_cmd("multigpu", 1, 1, "--dataset_size", 16, vision=["--sync_bn"])  # as test_gpu starts it
    proc = run(cmd, timeout=120, check=False, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout
    assert "error: --sync_bn needs GPUs: SyncBatchNorm does not run on the CPU" in proc.stdout, proc.stdout
    assert not list(tmp_path.iterdir())


def test_under_torchrun_its_refusals_are_said_once_at_the_end(tmp_path):
    """Under torchrun its refusals are said once as torchrun's closing error.

    As the lessons' refusals: local rank 0 records it for torchrun's summary, which ends with it; the
    other process ends quietly; nothing trains or is written. Mutation: usage() as it is without torchrun ->
    the message twice (each process prints it) and no ArgumentError in the summary: fails."""
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node=2", EXAMPLES / "vision.py", "--sync_bn"]
    proc = run([*cmd, EXAMPLES / "multigpu_torchrun.py", 1, 1], timeout=120, check=False, cwd=tmp_path)
    message = "--sync_bn needs GPUs: SyncBatchNorm does not run on the CPU"
    assert proc.returncode != 0 and proc.stdout.count(message) == 1, proc.stdout[-3000:]
    last = proc.stdout.strip().splitlines()[-3:]
    assert last[0].strip() == f"argparse.ArgumentError: {message}" and last[-1].startswith("====="), last
    assert not list(tmp_path.iterdir())
