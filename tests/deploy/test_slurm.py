"""examples/slurm/sbatch_run.sh as a real Slurm job spanning two nodes.

Needs a Slurm cluster with two idle nodes, each with at least 2 CPUs and 2 GPUs (gres), that see this
repository and the test's temporary directory: the one `harness/slurm_cluster.sh up` (or `make slurm-cluster`)
starts on this machine has them. Skipped when none answers, unless REQUIRE_SLURM=1.
"""

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import PYTHON, REPO, TrainLog, need, run

pytestmark = pytest.mark.slurm

JOB_SCRIPT = REPO / "examples" / "slurm" / "sbatch_run.sh"
CLUSTER = REPO / "harness" / "slurm_cluster.sh"
NODES = 2
PROCS_PER_NODE = 2
# Seconds from submission to a final state. A job takes under a minute on 2 idle cores, but the bound leaves
# room for a busy machine; the jobs' own time limit is shorter, so a hung job ends TIMEOUT before it.
JOB_BOUND = 720
JOB_TIME_LIMIT = "10"  # minutes
FINAL_STATES = {
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "TIMEOUT",
}


@pytest.fixture(scope="module")
def slurm_env():
    """Environment for Slurm commands: SLURM_CONF of the local cluster when it is up and none is set."""
    env = {}
    if "SLURM_CONF" not in os.environ:
        line = run([CLUSTER, "env"], timeout=10).stdout.strip()
        conf = line.split("=", 1)[1]
        if os.path.exists(conf):
            env["SLURM_CONF"] = conf
    try:
        proc = subprocess.run(
            ["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"],
            capture_output=True,
            text=True,
            timeout=20,
            env={**os.environ, **env},
        )
        idle = proc.stdout.split() if proc.returncode == 0 else []
        reason = (proc.stderr.strip().splitlines() or [f"{len(idle)} idle nodes"])[-1]
    except (OSError, subprocess.TimeoutExpired) as exc:
        idle, reason = [], str(exc)
    need(
        len(idle) >= NODES,
        f"no Slurm cluster with {NODES} idle nodes ({reason}); start one with `make slurm-cluster`",
        "REQUIRE_SLURM",
    )
    return env


def job_field(text, name):
    match = re.search(rf"\b{name}=(\S+)", text)
    return match.group(1) if match else None


def submit_and_wait(
    env, workdir, args, extra_env, sbatch_opts=(f"--cpus-per-task={PROCS_PER_NODE}",), while_running=None
):
    """sbatch the job script from the repository root with workdir as the job's directory, wait until it
    ends, calling while_running(output so far) once a second; return (final state, seconds from submission
    to that state, text of its output file)."""
    # The training processes on the CPU: the local cluster's GPUs are placeholders, for which Slurm still sets
    # CUDA_VISIBLE_DEVICES=0,1 on each node (on a machine with GPUs, the same two real ones on both "nodes").
    # `env CUDA_VISIBLE_DEVICES=` hides them again, as conftest.CPU_ENV does for every other test.
    torchrun = f"env CUDA_VISIBLE_DEVICES= {PYTHON} {REPO / 'tools' / 'launch.py'}"
    job_env = {**env, "TORCHRUN": torchrun, **extra_env}
    start = time.monotonic()
    proc = run(
        [
            "sbatch",
            "--parsable",
            f"--chdir={workdir}",
            f"--nodes={NODES}",
            f"--time={JOB_TIME_LIMIT}",
            *sbatch_opts,
            JOB_SCRIPT,
            *args,
        ],
        timeout=30,
        env=job_env,
        cwd=REPO,
    )
    job_id = proc.stdout.strip().split(";")[0]
    out_file = workdir / f"ddp-multinode-{job_id}.out"
    state = None
    while time.monotonic() - start < JOB_BOUND:
        info = run(["scontrol", "-o", "show", "job", job_id], timeout=20, env=env).stdout
        state = job_field(info, "JobState")
        if state in FINAL_STATES:
            break
        if while_running and out_file.exists():
            while_running(out_file.read_text())
        time.sleep(1)
    elapsed = time.monotonic() - start
    output = out_file.read_text() if out_file.exists() else f"(no {out_file})"
    if state not in FINAL_STATES:
        run(["scancel", job_id], timeout=20, env=env, check=False)
        pytest.fail(f"job {job_id} still {state} after {JOB_BOUND}s:\n{output[-4000:]}")
    return state, elapsed, output


# NPROC_PER_NODE is unset, so the job script derives the processes per node from the allocation: from
# --cpus-per-task, or from the GPUs per node (the local cluster's GPUs are count-only: the processes find no
# CUDA and train on the CPU, but Slurm allocates them and sets SLURM_GPUS_ON_NODE like on a GPU cluster).
@pytest.mark.parametrize(
    "script, allocation",
    [
        ("multinode.py", f"--cpus-per-task={PROCS_PER_NODE}"),
        ("multigpu_accelerate.py", f"--gpus-per-node={PROCS_PER_NODE}"),
    ],
)
def test_job_trains_across_two_nodes(slurm_env, tmp_path, script, allocation):
    snapshot = tmp_path / "shared" / "snapshot.pt"
    state, _, output = submit_and_wait(
        slurm_env,
        tmp_path,
        ["5", "2", "--seed", "0"],
        {"SCRIPT": script, "SNAPSHOT_PATH": str(snapshot)},
        sbatch_opts=[allocation],
    )
    assert state == "COMPLETED", output[-4000:]
    log = TrainLog(output)
    if script == "multinode.py":  # each process names its node and host
        assert log.num_hosts == NODES, output[-4000:]
        assert {place[4] for place in log.ranks.values()} == {str(n) for n in range(NODES)}
    log.assert_trained(world_size=NODES * PROCS_PER_NODE)
    assert snapshot.is_file(), output[-4000:]


def test_gpt_job_trains_across_two_nodes(slurm_env, tmp_path):
    """The GPT trainer (examples/gpt) as SCRIPT: 4 ranks on two nodes, one snapshot that all of them write."""
    snapshot = tmp_path / "shared" / "gpt"
    args = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "32", "--max_steps", "20"]
    args += [
        "--eval_every",
        "20",
        "--eval_samples",
        "16",
        "--sample_chars",
        "0",
        "--cache_dir",
        str(tmp_path),
    ]
    state, _, output = submit_and_wait(
        slurm_env, tmp_path, args, {"SCRIPT": "gpt/train.py", "SNAPSHOT_PATH": str(snapshot)}
    )
    assert state == "COMPLETED", output[-4000:]
    assert f"{NODES * PROCS_PER_NODE} process(es) on cpu" in output, output[-4000:]
    assert re.search(r"^step 20/20 \| loss", output, re.M), output[-4000:]
    assert (snapshot / "latest").is_file() and f"saved {snapshot} at step 20" in output, output[-4000:]


def test_job_without_rendezvous_fails_in_bound(slurm_env, tmp_path):
    # 192.0.2.1 is a documentation address (TEST-NET-1): nothing answers there, so the nodes never meet.
    state, elapsed, output = submit_and_wait(
        slurm_env,
        tmp_path,
        ["5", "2"],
        {"RDZV_HOST": "192.0.2.1", "SNAPSHOT_PATH": str(tmp_path / "snapshot.pt")},
    )
    assert state == "FAILED", output[-4000:]
    # FAILED, not TIMEOUT: the job ended by itself, bounded by read_timeout (30 s to reach the store, about
    # 45 s in all) plus start-up; 3 minutes leave room for a busy machine.
    assert elapsed < 180, f"took {elapsed:.0f}s to fail"
    assert "RendezvousConnectionError" in output, output[-4000:]
    assert "torchrun failed" in output and "did not meet at 192.0.2.1:" in output, output[-4000:]
    assert not TrainLog(output).ranks, output[-4000:]


def test_job_script_refuses_to_run_outside_slurm():
    proc = run(["bash", JOB_SCRIPT, "5", "2"], timeout=10, check=False, env={"SLURM_JOB_ID": ""})
    assert proc.returncode == 2
    assert "run this with sbatch" in proc.stdout


def test_the_job_gets_sigterm_early_enough_to_save_before_its_time_limit():
    # the GPT trainer saves on SIGTERM, after up to --log_every steps (docs/fault-tolerance.md); Slurm's
    # KillWait (30 s) alone is short of that for a step of seconds
    text = Path(JOB_SCRIPT).read_text()
    lead = re.search(r"^#SBATCH --signal=TERM@(\d+)$", text, re.M)
    wait = re.search(r"^export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=\$\{\w+:-(\d+)\}$", text, re.M)
    assert lead and wait and 90 <= int(wait[1]) < int(lead[1]), (lead, wait)


LAUNCHERS = (b"torchrun", b"launch.py")


def training_pids(marker, rank):
    """Training processes on this machine (the local cluster's nodes share it) with marker among their
    arguments and the given global RANK; torchrun itself is not one of them."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            marker.encode() in argv
            and f"RANK={rank}".encode() in environ
            and not any(a.endswith(LAUNCHERS) or b"torch.distributed.run" in a for a in argv)
        ):
            pids.append(int(proc.name))
    return pids


def test_job_resumes_after_a_training_process_dies(slurm_env, tmp_path):
    snapshot = str(tmp_path / "snapshot.pt")
    last_rank = NODES * PROCS_PER_NODE - 1  # on the second node, away from rank 0, which prints
    killed = []

    def kill_one_after_first_epoch(output):
        if killed or not re.search(r"^epoch 1/", output, re.MULTILINE):
            return
        for pid in training_pids(snapshot, last_rank):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    # A bigger dataset makes each epoch last a few seconds, so the kill lands in the middle of the run.
    state, _, output = submit_and_wait(
        slurm_env,
        tmp_path,
        ["3", "1", "--dataset_size", "40000"],
        {"SNAPSHOT_PATH": snapshot},
        while_running=kill_one_after_first_epoch,
    )
    assert killed, f"found no process of rank {last_rank} on this machine to kill:\n{output[-4000:]}"
    assert state == "COMPLETED", output[-4000:]
    assert "resuming from" in output, output[-4000:]
    log = TrainLog(output)
    assert log.epochs[-1] == 3, output[-4000:]
    log.assert_trained(world_size=NODES * PROCS_PER_NODE)
