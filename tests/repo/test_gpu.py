"""The GPU paths: NCCL, one process per GPU, weights on the GPU, the vision workload, doctor on GPUs.

Skipped where torch sees no GPU (CI has none); `make test` on a GPU machine runs them on every visible GPU.
"""

import json

import pytest
import torch
from helpers import (
    EXAMPLES,
    GPU_ENV,
    GPUS,
    PROGRAMS,
    PYTHON,
    REPO,
    TrainLog,
    example_cmd,
    free_port,
    load_snapshot,
    run,
)

pytestmark = pytest.mark.gpu
# What needs more than one GPU is skipped, saying so, on a one-GPU machine: at world size 1, DDP's
# equivalence and one GPU per rank hold trivially and would prove nothing.
needs_2_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs, one per rank; torch sees {GPUS} GPU(s)")

BATCH, EPOCHS = 32, 4
COMMON = ["--seed", "5", "--dataset_size", "4096", "--momentum", "0.9"]
DDP_EXAMPLES = ["multigpu", "multigpu_torchrun", "multigpu_accelerate"]


def train(name, folder, *args, nproc=GPUS, vision=False):
    folder.mkdir(parents=True, exist_ok=True)
    proc = run(example_cmd(name, *args, nproc=nproc, vision=vision), timeout=300, cwd=folder, env=GPU_ENV)
    return TrainLog(proc.stdout)


def devices(snapshot_path):
    """Where the saved weights lived: torch.save keeps each tensor's device."""
    state = torch.load(snapshot_path, map_location=None, weights_only=True)["MODEL_STATE"]
    return {tensor.device.type for tensor in state.values()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each example trained once on the GPUs; single_gpu takes the global batch of the others."""
    folder = tmp_path_factory.mktemp("gpu")
    logs = {}
    for name in ["single_gpu", *DDP_EXAMPLES]:
        batch = BATCH * GPUS if name == "single_gpu" else BATCH
        logs[name] = train(name, folder / name, EPOCHS, 2, "--batch_size", batch, *COMMON)
    return folder, logs


@pytest.mark.parametrize("name", ["single_gpu", *DDP_EXAMPLES])
def test_trains_on_the_gpus(runs, name):
    folder, logs = runs
    ddp = name != "single_gpu"
    logs[name].assert_trained(GPUS if ddp else 1, factor=10)
    assert logs[name].backend == ("nccl" if ddp else None), logs[name].text[-2000:]
    assert devices(folder / name / f"{name}_snapshot.pt") == {"cuda"}


@needs_2_gpus
@pytest.mark.parametrize("name", DDP_EXAMPLES)
def test_each_rank_runs_on_its_own_gpu(runs, name):
    """The set_device pitfall (docs/troubleshooting.md): rank r of one node on cuda:r, never all on cuda:0.
    Each rank's line names the device it built from its local rank: a mapping that puts two ranks on one
    GPU fails here. The line does not read torch.cuda.current_device(), so set_device itself is not what
    this checks."""
    ranks = runs[1][name].ranks
    assert {rank: place[0] for rank, place in ranks.items()} == {r: f"cuda:{r}" for r in range(GPUS)}, ranks


@needs_2_gpus
@pytest.mark.parametrize("name", DDP_EXAMPLES)
def test_ddp_with_nccl_equals_one_gpu_with_the_global_batch(runs, name):
    folder, logs = runs
    expected = load_snapshot(folder / "single_gpu" / "single_gpu_snapshot.pt")["MODEL_STATE"]
    actual = load_snapshot(folder / name / f"{name}_snapshot.pt")["MODEL_STATE"]
    for key, tensor in expected.items():  # GPU reductions may sum in another order than the CPU's
        torch.testing.assert_close(actual[key], tensor, rtol=1e-4, atol=1e-5)
    assert logs[name].losses == pytest.approx(logs["single_gpu"].losses, rel=1e-3)


@pytest.mark.skipif(GPUS < 2, reason=f"DataParallel needs 2 or more GPUs; torch sees {GPUS} GPU(s)")
def test_dataparallel_equals_one_gpu_with_the_same_batch(runs, tmp_path):
    folder, logs = runs
    log = train("multigpu_dataparallel", tmp_path, EPOCHS, 2, "--batch_size", BATCH * GPUS, *COMMON)
    log.assert_trained(1, factor=10)  # one process
    snapshot = tmp_path / "multigpu_dataparallel_snapshot.pt"
    assert devices(snapshot) == {"cuda"}
    expected = load_snapshot(folder / "single_gpu" / "single_gpu_snapshot.pt")["MODEL_STATE"]
    actual = load_snapshot(snapshot)["MODEL_STATE"]
    assert actual.keys() == expected.keys()  # the plain model's names: model.module was saved
    for key, tensor in expected.items():  # the GPUs' gradients are summed in another order
        torch.testing.assert_close(actual[key], tensor, rtol=1e-4, atol=1e-5)
    assert log.losses == pytest.approx(logs["single_gpu"].losses, rel=1e-3)


def test_resume_on_the_gpus_ends_where_an_uninterrupted_run_ends(runs, tmp_path):
    folder, logs = runs
    args = ["--batch_size", BATCH, *COMMON]
    train("multigpu_torchrun", tmp_path, 2, 2, *args)
    resumed = train("multigpu_torchrun", tmp_path, EPOCHS, 2, *args)
    assert resumed.epochs == [3, 4], resumed.text[-2000:]
    assert resumed.losses == logs["multigpu_torchrun"].losses[2:]
    expected = load_snapshot(folder / "multigpu_torchrun" / "multigpu_torchrun_snapshot.pt")
    actual = load_snapshot(tmp_path / "multigpu_torchrun_snapshot.pt")
    torch.testing.assert_close(actual["MODEL_STATE"], expected["MODEL_STATE"], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["single_gpu", *DDP_EXAMPLES, "recipe", "recipe_accelerate"])
def test_each_script_stops_and_resumes_on_one_gpu(tmp_path, name):
    """Every lesson, the recipe and its twin: one epoch on one GPU, then the same command to two resumes
    from the snapshot and trains epoch 2 (the recipe's optimizer state loaded beside its weights on the GPU,
    where a first step mixing devices would fail)."""
    args = [] if name.startswith("recipe") else ["--batch_size", BATCH, *COMMON]
    run(example_cmd(name, 1, 1, *args, nproc=1), timeout=300, cwd=tmp_path, env=GPU_ENV)
    resumed = run(example_cmd(name, 2, 1, *args, nproc=1), timeout=300, cwd=tmp_path, env=GPU_ENV).stdout
    assert "resuming from " in resumed and "epoch 2/2 " in resumed, resumed[-3000:]


def test_more_processes_than_gpus_is_refused_before_any_work(tmp_path):
    too_many = GPUS + 1
    spawn = run([PYTHON, EXAMPLES / "multigpu.py", 1, 1, "--nproc", too_many], timeout=120, check=False,
                cwd=tmp_path, env=GPU_ENV)  # fmt: skip
    assert spawn.returncode == 2, spawn.stdout[-2000:]
    assert f"--nproc must be between 1 and the number of GPUs, got {too_many}" in spawn.stdout
    torchrun = run(example_cmd("multigpu_torchrun", 1, 1, nproc=too_many), timeout=120, check=False,
                   cwd=tmp_path, env=GPU_ENV)  # fmt: skip
    # under torchrun the lesson leaves it to CUDA, as docs/troubleshooting.md says
    assert torchrun.returncode != 0 and "invalid device ordinal" in torchrun.stdout, torchrun.stdout[-2000:]
    assert not list(tmp_path.iterdir())


def test_vision_on_the_gpus(tmp_path):
    log = train("multigpu_torchrun", tmp_path, 4, 4, "--dataset_size", 1024, vision=True)
    log.assert_trained(GPUS, factor=2)
    assert log.backend == "nccl"
    assert devices(tmp_path / "multigpu_torchrun_snapshot.pt") == {"cuda"}


def test_vision_with_sync_batchnorm_on_the_gpus(tmp_path):
    """--sync_bn: ResNet-18's BatchNorm layers made SyncBatchNorm before DDP; it trains on every GPU (its
    numbers against one process: examples/pitfalls/batchnorm_stats.py --fixed, in test_pitfalls)."""
    log = train("multigpu_torchrun", tmp_path, 3, 3, "--dataset_size", 512, vision=["--sync_bn"])
    log.assert_trained(GPUS, factor=2)
    assert devices(tmp_path / "multigpu_torchrun_snapshot.pt") == {"cuda"}


@needs_2_gpus
def test_multinode_through_the_launcher_with_nccl(tmp_path):
    cmd = [PYTHON, REPO / "tools" / "launch.py", "--nnodes=1", f"--nproc-per-node={GPUS}"]
    cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{free_port()}", "--rdzv-conf=join_timeout=60"]
    proc = run([*cmd, EXAMPLES / "multinode.py", 3, 3, *COMMON], timeout=300, cwd=tmp_path, env=GPU_ENV)
    log = TrainLog(proc.stdout)
    log.assert_trained(GPUS, factor=10)
    assert log.backend == "nccl"


def test_doctor_on_the_gpus(tmp_path):
    proc = run([PYTHON, REPO / "tools" / "doctor.py"], timeout=300, check=False, cwd=tmp_path, env=GPU_ENV)
    assert proc.returncode == 0, proc.stdout
    assert f"INFO  gpus         {GPUS}: {torch.cuda.get_device_name(0)}" in proc.stdout, proc.stdout
    assert f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}" in proc.stdout
    backend = "nccl" if GPUS >= 2 else "gloo on the CPU"  # two processes never share one GPU
    assert f"PASS  all-reduce   2 local processes agree on the sum ({backend})" in proc.stdout


@pytest.mark.skipif(GPUS < 2, reason=f"an NCCL timeout needs two ranks, one GPU each; torch sees {GPUS}")
def test_an_nccl_timeout_is_reported_with_flight_recorder_dumps(tmp_path):
    """An NCCL timeout is reported and the flight recorder dumps what each rank ran.

    docs/troubleshooting.md: TORCH_NCCL_TRACE_BUFFER_SIZE records the collectives; on a timeout the
    watchdog names the one that timed out and writes the record of the rank that waited."""
    script = PROGRAMS / "nccl_timeout.py"
    env = {
        **GPU_ENV,
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "nccl_trace_rank_"),
    }
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", script]
    proc = run(cmd, timeout=120, check=False, cwd=tmp_path, env=env)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "Watchdog caught collective operation timeout" in proc.stdout, proc.stdout[-3000:]
    assert list(tmp_path.glob("nccl_trace_rank_*")), proc.stdout[-3000:]  # the flight recorder's dump


def test_tp_at_world_size_1_on_nccl_trains_with_fused_adamw(tmp_path):
    """Tensor parallel's optimizer path on the GPU (fused AdamW over DTensors, loss parallel, found_inf):
    the probe of tests/gpt/test_gpt_model_parallel.py, on NCCL."""
    from test_gpt_model_parallel import tp_at_world_size_1

    backend, first, last = tp_at_world_size_1(tmp_path, env=GPU_ENV)
    assert backend == "nccl" and last < first - 0.5, (backend, first, last)


def test_an_ordinary_gpt_step_on_the_gpu_waits_for_nothing(tmp_path):
    """tests/programs/host_reads.py on the GPU, one process, bf16: CUDA's sync debug mode warns of every
    call in a step that waits for the device; the steps that neither log, evaluate nor save have none."""
    from gpt_helpers import train

    args = ["--max_steps", 12, "--log_every", 4, "--eval_every", 8, "--save_every", 5, "--batch_size", 8]
    cache = tmp_path / "cache"
    train(tmp_path, cache, *args, script=PROGRAMS / "host_reads.py", env=GPU_ENV)
    found = json.loads((tmp_path / "reads.rank0.json").read_text())
    reads = {int(step): count for step, count in found["reads"].items()}
    assert found["checked"] == [4, 6, 8, 11, 12], found
    assert all(reads[s] == 0 for s in reads if s not in found["checked"]), str(reads)


@needs_2_gpus
def test_syncbatchnorm_makes_two_gpus_train_and_evaluate_as_one_process():
    """examples/pitfalls/batchnorm_stats.py on 2 GPUs, NCCL: 4 images a process with plain BatchNorm end
    off one process of 8 (its loss or its eval outputs by more than 1e-4, float32 convolutions); with
    SyncBatchNorm (--fixed) within 1e-4, train and eval mode both. On the CPU the fix is refused, saying
    why (tests/repo/test_pitfalls.py)."""
    script = REPO / "examples" / "pitfalls" / "batchnorm_stats.py"
    broken = run([PYTHON, script], timeout=180, env=GPU_ENV, check=False)
    assert broken.returncode == 1 and "cause: per-process BatchNorm" in broken.stdout, broken.stdout[-2000:]
    fixed = run([PYTHON, script, "--fixed"], timeout=180, env=GPU_ENV)
    assert "fixed: 2 processes of 4 images train and evaluate as one of 8" in fixed.stdout, fixed.stdout
