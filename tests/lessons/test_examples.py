"""The examples train, agree with each other, resume exactly and run from a lone copy."""

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import threading
import time

import pytest
import torch
from helpers import (
    EXAMPLES,
    EXIT_PROBE,
    PYTHON,
    REFERENCE_ARGS,
    REFERENCE_BATCH,
    REFERENCE_EPOCHS,
    REPO,
    SITES,
    SPAWN_BY_FORK,
    VENV,
    TrainLog,
    bound,
    example_cmd,
    free_port,
    kill_group,
    load_snapshot,
    once_per_session,
    popen,
    run,
    run_together,
    steps,
)

pytestmark = pytest.mark.quick

# Per-process batch size and world size of the DDP runs; single_gpu (the session's reference run, shared
# with tests/deploy/test_ray.py) gets their product as its batch.
BATCH, NPROC = 32, 2
EPOCHS = REFERENCE_EPOCHS
assert BATCH * NPROC == REFERENCE_BATCH
# Momentum gives the optimizer a state of its own, which the snapshot must carry for an exact resume.
COMMON = REFERENCE_ARGS
DDP_EXAMPLES = ["multigpu", "multigpu_torchrun", "multigpu_accelerate"]


class Run:
    def __init__(self, name, folder, proc):
        self.folder = folder
        self.log = TrainLog(proc.stdout)
        self.snapshot = folder / f"{name}_snapshot.pt"


@pytest.fixture(scope="module")
def runs(single_gpu_reference):
    """Each example trained once, from a copy alone in an empty folder (so nothing else can be imported):
    once in the session, for both workers (this file's tests go to both)."""

    def make(folder):
        outs = {}
        for name in DDP_EXAMPLES:
            (folder / name).mkdir()
            script = shutil.copy(EXAMPLES / f"{name}.py", folder / name)
            args = [EPOCHS, 2, "--batch_size", BATCH, *COMMON]
            cmd = example_cmd(name, *args, nproc=NPROC, script=script)
            outs[name] = run(cmd, timeout=300, cwd=folder / name, env=EXIT_PROBE).stdout
        return outs

    folder, outs = once_per_session("lesson_runs", make)
    results = {"single_gpu": Run("single_gpu", *single_gpu_reference)}
    for name in DDP_EXAMPLES:
        results[name] = Run(name, folder / name, subprocess.CompletedProcess([], 0, outs[name]))
    return results


@pytest.mark.parametrize("name", ["single_gpu", *DDP_EXAMPLES])
def test_trains_from_a_lone_copy(runs, name):
    """Trains, says what it was told to, warns of nothing (a deprecated call warned once per rank, before
    epoch 1) and writes only its snapshot. Mutation: the loss averaged by torch.distributed.nn.all_reduce,
    deprecated: its FutureWarning fails this."""
    result = runs[name]
    assert "Warning" not in result.log.text, result.log.text[-3000:]
    world_size = 1 if name == "single_gpu" else NPROC
    result.log.assert_trained(world_size, factor=10)
    assert result.log.epochs == list(range(1, EPOCHS + 1))
    assert result.log.backend == (None if name == "single_gpu" else "gloo")  # no GPU visible: gloo
    if name != "single_gpu":  # every process announced itself
        assert sorted(result.log.ranks) == list(range(NPROC))
    # Only what the run was asked to write: no stray temporary snapshot files.
    written = sorted(p.name for p in result.folder.iterdir())
    assert written == sorted([f"{name}.py", f"{name}_snapshot.pt"])


@pytest.mark.parametrize("name", DDP_EXAMPLES)
def test_no_communication_thread_outlives_the_process_group(runs, name):
    """destroy_process_group() really ends the group: no gloo thread is left to run during interpreter
    shutdown, where one can abort a finished run (exit -6). DDP's first use imports a module that would
    keep the group alive if the lesson had not imported it before the group existed. Mutation: rank 1 of
    multigpu.py leaving by os._exit(0) after destroy_process_group(): 1 training process reported for 2."""
    text = runs[name].log.text
    reports = re.findall(r"exit probe: pid (\d+), process group: (yes|no), gloo threads alive: (\d+)", text)
    trained = {pid for pid, group, _ in reports if group == "yes"}
    # one report from each training process (the launcher and multiprocessing's helpers report "no")
    assert len(trained) == NPROC == sum(group == "yes" for _, group, _ in reports), text[-3000:]
    assert [alive for *_, alive in reports] == ["0"] * len(reports), text[-3000:]


@pytest.mark.parametrize("name", ["single_gpu", *DDP_EXAMPLES])
def test_snapshot_contract(runs, name):
    result = runs[name]
    snapshot = load_snapshot(result.snapshot)
    assert snapshot["EPOCHS_RUN"] == EPOCHS
    assert set(snapshot) == {"MODEL_STATE", "OPTIMIZER_STATE", "EPOCHS_RUN"}
    assert set(snapshot["MODEL_STATE"]) == {"weight", "bias"}  # the unwrapped model: no "module." prefix
    assert snapshot["OPTIMIZER_STATE"]["state"], "optimizer state (momentum) is saved"


@pytest.mark.parametrize("name", DDP_EXAMPLES)
def test_ddp_equals_single_process_with_the_global_batch(runs, name):
    """N processes with batch b take the same steps as one process with batch N*b."""
    expected = load_snapshot(runs["single_gpu"].snapshot)["MODEL_STATE"]
    actual = load_snapshot(runs[name].snapshot)["MODEL_STATE"]
    for key, tensor in expected.items():
        torch.testing.assert_close(actual[key], tensor, rtol=1e-5, atol=1e-6)
    assert runs[name].log.losses == pytest.approx(runs["single_gpu"].log.losses, rel=1e-4)


def test_accelerate_launch_configs_take_one_process_steps(runs, tmp_path):
    """Accelerate launch with the committed configs takes the steps of one process.

    `accelerate launch --config_file examples/accelerate/one_node.yaml` (2 processes of batch 32), then
    two_nodes.yaml as two local nodes (node1 with --machine_rank 1; 4 processes of batch 16, node0's
    address and port given on the command line): each ends with the single-process run's weights at the
    global batch of 64, the nodes meeting as the YAML says; so does torchrun's one process of batch 64 (`make
    accelerate` on a one-GPU machine). Mutations: two_nodes.yaml's num_processes 2 (one a node): the world
    size is 2, the global batch 32, and the weights differ; the lesson's DataLoader given whole batches (a
    BatchSampler as its sampler, batch_size=None): with one process accelerate 1.15's prepare() fails."""
    launch = [VENV / "bin" / "accelerate", "launch", "--config_file"]
    lesson = [EXAMPLES / "multigpu_accelerate.py", EPOCHS, 2, *COMMON]
    configs = EXAMPLES / "accelerate"
    (tmp_path / "one").mkdir()
    one = run(
        [*launch, configs / "one_node.yaml", *lesson, "--batch_size", BATCH],
        timeout=300,
        cwd=tmp_path / "one",
    )
    TrainLog(one.stdout).assert_trained(world_size=2)
    (tmp_path / "alone").mkdir()
    cmd = example_cmd("multigpu_accelerate", EPOCHS, 2, *COMMON, "--batch_size", BATCH * NPROC, nproc=1)
    TrainLog(run(cmd, timeout=300, cwd=tmp_path / "alone").stdout).assert_trained(world_size=1)
    node = [*launch, configs / "two_nodes.yaml", "--main_process_ip", "127.0.0.1"]
    node += ["--main_process_port", free_port(), "--rdzv_conf", "timeout=60"]
    nodes = [[*node, "--machine_rank", rank, *lesson, "--batch_size", BATCH // 2] for rank in (0, 1)]
    codes, outs = zip(*run_together(nodes, timeout=300, cwd=tmp_path), strict=True)
    assert codes == (0, 0), outs
    TrainLog(outs[0]).assert_trained(world_size=4)
    expected = load_snapshot(runs["single_gpu"].snapshot)["MODEL_STATE"]
    for folder in (tmp_path / "one", tmp_path / "alone", tmp_path):
        actual = load_snapshot(folder / "multigpu_accelerate_snapshot.pt")["MODEL_STATE"]
        for key, tensor in expected.items():
            torch.testing.assert_close(actual[key], tensor, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["single_gpu", "multigpu_torchrun", "multigpu_accelerate"])
def test_resume_ends_exactly_where_an_uninterrupted_run_ends(runs, tmp_path, name):
    """Stopped after 2 epochs and run again to 4, a lesson ends bit for bit where one run of 4 ends; run once
    more, it trains nothing. The second run saves every 3 epochs: its last snapshot is saved because epoch 4
    is the last. Mutation: no save at the last epoch (multigpu_torchrun.py) -> it ends with epoch 3's."""
    args = ["--batch_size", BATCH * NPROC if name == "single_gpu" else BATCH, *COMMON]
    first = run(example_cmd(name, 2, 2, *args), timeout=300, cwd=tmp_path)
    assert TrainLog(first.stdout).epochs == [1, 2]
    second = run(example_cmd(name, EPOCHS, 3, *args), timeout=300, cwd=tmp_path)
    assert second.stdout.count(f"resuming from {name}_snapshot.pt: 2 epochs already run\n") == 1, (
        "one process"
    )
    assert TrainLog(second.stdout).epochs == [3, 4], "the saved epoch is not run again"
    assert TrainLog(second.stdout).losses == runs[name].log.losses[2:]
    resumed = load_snapshot(tmp_path / f"{name}_snapshot.pt")
    uninterrupted = load_snapshot(runs[name].snapshot)
    for part in ("MODEL_STATE", "OPTIMIZER_STATE"):  # bit for bit, momentum buffers included
        torch.testing.assert_close(resumed[part], uninterrupted[part], rtol=0, atol=0)
    third = run(example_cmd(name, EPOCHS, 2, *args), timeout=300, cwd=tmp_path)
    assert TrainLog(third.stdout).epochs == [], "a finished run trains nothing more"
    # said once, by one process
    done = f"resuming from {name}_snapshot.pt: {EPOCHS} epochs already run\n"
    assert third.stdout.count(done) == 1, third.stdout[-3000:]
    assert third.returncode == 0


@pytest.mark.parametrize("name", ["single_gpu", "multigpu", "multigpu_torchrun", "make multigpu"])
def test_ctrl_c_ends_a_lesson_in_one_line_naming_its_snapshot(tmp_path, name):
    """Ctrl-C (SIGINT to the launcher's process group, as a terminal sends it) a moment after epoch 6 of a
    long run, alone, under mp.spawn and under torchrun: one line says the same command resumes from the
    snapshot at the epoch after the whole number of save_every epochs it holds; no process prints a
    traceback or KeyboardInterrupt; exit status 130 (torchrun's is 1, after its own SignalException report,
    which a lesson cannot shorten: docs/lessons.md says so). Mutations: the except KeyboardInterrupt
    removed from the lesson -> tracebacks, and the test fails; the epoch said as the snapshot's count ->
    fails. Through `make multigpu` too: the lesson's line, then make's (`Error 130`), and no traceback of
    make's wrapper (harness/steps.py: 17 lines of it before)."""
    if name == "make multigpu":
        cmd = ["make", "--no-print-directory", "-C", REPO, "multigpu", f"RUNS={tmp_path}", f"VENV={VENV}"]
        cmd += ["EPOCHS=100000", "ARGS=--dataset_size 256"]
        snapshot = tmp_path / "multigpu" / "snapshot.pt"
    else:
        cmd = example_cmd(name, 100000, 5, "--dataset_size", 256)
        snapshot = tmp_path / f"{name}_snapshot.pt"
    proc = popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(bound(120), kill_group, [proc])  # a run that never reaches epoch 6
    watchdog.start()
    before = []
    for line in proc.stdout:
        before.append(line)
        if line.startswith("epoch 6/"):
            break
    time.sleep(random.Random(name).random())  # a moment within the next epochs: where Ctrl-C lands
    os.killpg(proc.pid, signal.SIGINT)
    after = proc.communicate(timeout=bound(60))[0]
    watchdog.cancel()
    where = snapshot if name == "make multigpu" else snapshot.name
    said = re.findall(
        rf"^stopped by Ctrl-C: the same command resumes from {where} at epoch (\d+)$", after, re.M
    )
    assert len(said) == 1, "".join(before)[-2000:] + after[-3000:]
    assert "KeyboardInterrupt" not in after and not re.search(r"^\[rank\d+\]:", after, re.M), after[-3000:]
    if name == "multigpu_torchrun":
        assert proc.returncode == 1 and "SignalException" in after, after[-3000:]
    else:
        code = -signal.SIGINT if name == "make multigpu" else 130  # make ends as Ctrl-C ends it
        assert proc.returncode == code and "Traceback" not in after, after[-3000:]
    saved = load_snapshot(snapshot)["EPOCHS_RUN"]
    assert saved >= 5 and saved % 5 == 0 and int(said[0]) == saved + 1, (saved, said)


@pytest.mark.parametrize("name", DDP_EXAMPLES)
def test_each_start_line_is_written_whole(tmp_path, name):
    """Unbuffered (as in the image), print() writes the text and its newline apart, and two processes'
    start lines interleave ("[rank 1/2] cpu, gloo[rank 0/2] cpu, gloo"): each is one write."""
    args = [1, 1, "--dataset_size", 64, "--snapshot_path", "snap.pt"]
    proc = run(
        example_cmd(name, *args), timeout=300, cwd=tmp_path, env={"PYTHONPATH": str(SITES / "write_marks")}
    )
    starts = re.findall(r"\[rank \d/2\][^\n]*\n\x1e?", proc.stdout)
    assert len(starts) == NPROC, proc.stdout[-3000:]
    # the newline in the same write as the text; "cpu" as in every lesson ("cpu:0" reads as GPU 0)
    assert all(re.fullmatch(r"\[rank \d/2\] cpu, gloo\n\x1e", line) for line in starts), starts


def test_the_batch_size_lesson_quotes_what_its_commands_print(tmp_path):
    """docs/lessons.md explains the first epochs with the number of processes, and the two remedies, by
    commands and the losses they print: run each (2 of its epochs: the first two do not depend on the total)
    and compare, to one unit in the sixth digit the lessons print. MKL picks its kernels by the CPU's
    instruction set: on an AVX-512 machine `--nproc 4 --lr 0.2` printed 0.000103048 for the page's
    0.000103047 (AVX2; MKL_CBWR=AVX2 gave it back there). Mutation: the page's 2.10244 as 2.10254: fails.

    The five commands the page quotes, their ranks forked from the parent (SPAWN_BY_FORK: the losses are
    the subject, not how a process starts; the page's commands spawn)."""
    text = (REPO / "docs" / "lessons.md").read_text()
    section = text.split("## Why the first epochs differ")[1].split("\n## ")[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if "loss after epoch 1" in cells:  # a table's header: where its epoch 1 and 2 columns are
            columns = cells.index("loss after epoch 1"), cells.index("epoch 2")
        command = re.search(r"`python (examples/\S+\.py) 10 5([^`]*)`", line)
        if command:
            rows.append((*command.groups(), cells[columns[0]], cells[columns[1]]))
    assert len(rows) == 5, rows  # three process counts, two remedies
    for script, options, first, second in rows:
        cmd = [VENV / "bin" / "python", REPO / script, 2, 1, *options.split(), "--snapshot_path", "s.pt"]
        losses = TrainLog(run(cmd, timeout=300, cwd=tmp_path, env=SPAWN_BY_FORK).stdout).losses
        (tmp_path / "s.pt").unlink()
        assert losses == pytest.approx([float(first), float(second)], rel=1e-5, abs=0), (script, options)


def test_make_prints_the_command_it_runs_which_trains_when_copied(tmp_path):
    """make torchrun hides its own recipe (python3 harness/steps.py ...): the first line is the torchrun
    command it runs, and that line, pasted into a shell at the repository root, runs the same training (here
    it resumes the finished run). Mutation: steps.py's print removed -> the first line is rank 0's: fails."""
    make = ["make", "--no-print-directory", "-C", REPO, "torchrun", "EPOCHS=1", f"RUNS={tmp_path}"]
    out = run([*make, f"VENV={VENV}", "ARGS=--dataset_size 64"], timeout=300).stdout
    first = out.splitlines()[0]
    assert "steps.py" not in out and " examples/multigpu_torchrun.py 1 " in first, out[:2000]
    torchrun = f"OMP_NUM_THREADS=1 {VENV}/bin/python -m torch.distributed.run --standalone "
    assert first.startswith(torchrun), first
    again = run(["bash", "-c", first], timeout=300, cwd=REPO).stdout
    assert f"resuming from {tmp_path}/torchrun/snapshot.pt: 1 epochs already run" in again, again[-2000:]


def test_make_multinode_trains_on_two_local_nodes(tmp_path):
    make = ["make", "-C", REPO, "multinode", "EPOCHS=3", f"RUNS={tmp_path}", f"VENV={VENV}"]
    make.append(f"RDZV_PORT={free_port()}")
    proc = run([*make, "ARGS=--dataset_size 512"], timeout=300)
    log = TrainLog(proc.stdout)
    log.assert_trained(world_size=4)
    # global ranks 0-3; each node numbers its own processes 0-1; node 0 holds global ranks 0 and 1
    places = {rank: (local, node) for rank, (_, _, local, _, node, _) in log.ranks.items()}
    assert places == {0: ("0", "0"), 1: ("1", "0"), 2: ("0", "1"), 3: ("1", "1")}, proc.stdout[-3000:]
    assert (tmp_path / "multinode" / "snapshot.pt").exists()
    # make sets OMP_NUM_THREADS, as torchrun would, so torchrun's 4-line banner about it opens no run
    assert "OMP_NUM_THREADS" not in proc.stdout, proc.stdout[:2000]


# every place that starts torchrun for a user (the k8s overlays and compose's other files take these bases)
TORCHRUN_LAUNCHERS = ["Makefile", "harness/steps.py", "compose/compose.yaml", "compose/torchft.yaml"]
TORCHRUN_LAUNCHERS += ["examples/slurm/sbatch_run.sh", "k8s/job/job.yaml", "k8s/trainjob/trainjob.yaml"]


@pytest.mark.parametrize("path", TORCHRUN_LAUNCHERS)
def test_every_torchrun_launcher_sets_one_thread_a_process(path):
    """torchrun's own default, set where it starts so that its 4-line OMP_NUM_THREADS banner opens no run
    (make multinode's output is checked above; k8s's values equal compose's in test_k8s). Mutation: the
    setting removed from one file: that case fails."""
    text = (REPO / path).read_text()
    assert re.search(r'OMP_NUM_THREADS(=\$+\{OMP_NUM_THREADS:-1\}|", "1"|: "1"|\n\s+value: "1")', text), path


def test_torchruns_static_form_trains_two_nodes_without_a_traceback(tmp_path):
    """Torchrun's static form trains two local nodes and ends without a traceback.

    docs/lessons.md's other form, `--node-rank N --master-addr A --master-port P`, on two local nodes of
    2 processes, 3 times (each in a folder of its own): both nodes exit 0, node 1 holds global ranks 2 and
    3, and neither prints a traceback but the one docs/lessons.md names: torch's exit barrier on node 1
    when node 0, which holds the store, has already left (pytorch#69520; 1 run in 10 at a load of 5).
    Mutation: both nodes given --node-rank=0: they never meet and the bounded wait fails the run."""
    for attempt in range(3):
        folder = tmp_path / str(attempt)
        folder.mkdir()
        port = free_port()
        nodes = [
            [PYTHON, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2", f"--node-rank={rank}",
             "--master-addr=127.0.0.1", f"--master-port={port}", EXAMPLES / "multinode.py", "3", "1",
             "--dataset_size", "512", "--timeout", "60"]
            for rank in (0, 1)
        ]  # fmt: skip
        ended = run_together(nodes, timeout=180, cwd=folder, env={"OMP_NUM_THREADS": "1"})
        codes, outs = zip(*ended, strict=True)
        assert codes == (0, 0), outs
        TrainLog(outs[0]).assert_trained(world_size=4)
        assert sorted(TrainLog(outs[1]).ranks) == [2, 3], outs[1]
        for out in outs:  # a traceback only as a line of the exit barrier's own log record (its prefix)
            barrier = re.findall(
                r"^(.*/elastic/agent/server/api\.py:\d+\]) Error waiting on exit barrier", out, re.M
            )
            tracebacks = [line for line in out.splitlines() if "Traceback" in line]
            assert all(any(line.startswith(f"{b} ") for b in barrier) for line in tracebacks), out


def listening(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def start_two_nodes(tmp_path, args, vision):
    """multinode.py's two torchrun nodes in folders a and b, node 0 first (it hosts the store); their
    processes and outputs once both have ended."""
    nodes = steps.command("multinode", args, nproc=2, port=(port := free_port()), root=REPO, vision=vision)
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    procs = [popen(nodes[0], cwd=tmp_path / "a", **pipes)]
    try:
        deadline = time.monotonic() + bound(120)
        while not listening(port):
            assert time.monotonic() < deadline and procs[0].poll() is None, "node 0's store never listened"
            time.sleep(0.2)
        procs.append(popen(nodes[1], cwd=tmp_path / "b", **pipes))
        outs = [proc.communicate(timeout=bound(300))[0] for proc in procs]
    finally:
        for proc in procs:
            kill_group(proc)
    return procs, outs


@pytest.mark.parametrize("case", ["differs", "does not fit"])
def test_multinode_refusals_are_said_once_per_node_in_torchruns_summary(tmp_path, case):
    """differs: node 0 finds a snapshot, node 1 (another folder: no shared storage) none: stop, do not train
    apart; every process finds it, each node says it once. does not fit: both find a tiny run's snapshot,
    given to the vision workload; node 0 says why, whole, node 1 that rank 0 could not resume. Each is said
    as the error of that node's torchrun closing summary; nothing trains, nothing is written. Node 0 starts
    first, so it hosts the rendezvous store (and holds rank 0): a node whose torchrun outlives the store's
    may be told instead that it cannot reach it, which is torchrun's way whenever nodes fail together: the
    two nodes start again then, up to 3 times, until node 1 has said it too."""
    for node in ("a", "b"):
        (tmp_path / node).mkdir()
    run(example_cmd("single_gpu", 1, 1, "--snapshot_path", "snap.pt"), timeout=300, cwd=tmp_path / "a")
    args = [2, 1, "--snapshot_path", "snap.pt"]
    if case == "does not fit":
        shutil.copy(tmp_path / "a" / "snap.pt", tmp_path / "b")
        args += ["--dataset_size", 16]
    before = {node: sorted(os.listdir(tmp_path / node)) for node in ("a", "b")}
    if case == "differs":
        message = "argparse.ArgumentError: the nodes found different snapshots at snap.pt: share it"
    else:
        message = "argparse.ArgumentError: error: cannot resume from snap.pt: RuntimeError('Error(s) in load"
    lost = ("could not reach the rendezvous store", "was closed: another node ended the job")
    for _ in range(3):  # node 1 says it once in 3 tries at most; a try where it lost the store says nothing
        procs, outs = start_two_nodes(tmp_path, args, vision=case == "does not fit")
        if case == "does not fit":
            assert 'Missing key(s) in state_dict: "conv1.weight"' in outs[0], outs[0][-3000:]
        for proc, out in zip(procs, outs, strict=True):
            assert proc.returncode and "| loss " not in out, out[-3000:]  # failed, nothing trained
        assert outs[0].count(message) == 1 and f"  {message}" in outs[0], outs[0][-3000:]
        if not any(words in outs[1] for words in lost):
            break
    assert outs[1].count(message) == 1 and f"  {message}" in outs[1], outs[1][-3000:]
    assert {node: sorted(os.listdir(tmp_path / node)) for node in ("a", "b")} == before


def test_dataparallel_without_2_gpus_refuses_and_writes_nothing(tmp_path):
    """DataParallel without 2 GPUs refuses says what to run instead and writes nothing."""
    cmd = example_cmd("multigpu_dataparallel", 2, 1)  # no GPU visible
    proc = run(cmd, timeout=120, check=False, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout  # a refusal is not a success
    assert "DataParallel needs 2 or more GPUs and this machine has 0: run single_gpu.py" in proc.stdout
    assert "multigpu.py (DDP, also on the CPU)" in proc.stdout
    assert not list(tmp_path.iterdir())
