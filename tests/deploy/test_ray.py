"""examples/multigpu_ray.py on Ray clusters on this machine (harness/ray_local.py), 2 CPU workers on gloo.

`make ray` starts a cluster, trains and stops it; a run given no address starts one for itself (ray.init());
the other runs share one cluster (about 3 s to start here, 30 s on a loaded machine), each from a copy of the
script alone in an empty folder. 70 to 100 s in all.
"""

import re
import shutil
import socket
import tempfile

import psutil
import pytest
import torch
from helpers import (
    EXAMPLES,
    PYTHON,
    RAY_PREFIX_RE,
    REFERENCE_ARGS,
    REFERENCE_BATCH,
    REFERENCE_EPOCHS,
    REPO,
    VENV,
    TrainLog,
    load_snapshot,
    run,
    without_ray_prefixes,
)
from ray_local import LocalRay

BATCH, NPROC, EPOCHS = 32, 2, 4
COMMON = ["--seed", "3", "--momentum", "0.9"]  # momentum: optimizer state the snapshot must carry
HEAD_RE = re.compile(r"^Ray head at ([\d.]+:\d+) \(([^)]+)\), up in", re.M)


def log_of(text):
    return TrainLog(without_ray_prefixes(text))


def leftovers(text, folder=None):
    """Processes still alive that the run's Ray started: the head's own (their command lines name its
    folder, by default the one harness/ray_local.py printed) and the actors whose lines the output shows."""
    folder = folder or HEAD_RE.search(text).group(2)
    pids = {int(pid) for pid in RAY_PREFIX_RE.findall(text)}
    alive = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        if proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if proc.info["pid"] in pids or any(folder in arg for arg in proc.info["cmdline"] or []):
            alive.append(proc.info)
    return alive


@pytest.fixture(scope="module")
def cluster():
    head = LocalRay(num_cpus=NPROC)
    yield head
    head.stop()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """`make ray`: a cluster of its own for the run, trained with 2 workers of batch 32, then stopped."""
    runs = tmp_path_factory.mktemp("runs")
    args = f"ARGS=--batch_size {BATCH} {' '.join(COMMON)}"
    make = ["make", "-C", REPO, "ray", f"EPOCHS={EPOCHS}", "SAVE_EVERY=2", f"RUNS={runs}", f"VENV={VENV}"]
    proc = run([*make, "NPROC=2", args], timeout=600)
    return proc.stdout, runs / "ray" / "snapshot.pt"


def train(folder, *args, address, check=True, env=None):
    """The script, copied alone into folder, run there on the cluster at address (None: no --address)."""
    script = shutil.copy(EXAMPLES / "multigpu_ray.py", folder)
    cmd = [PYTHON, script, *args, *(["--address", address] if address else [])]
    return run(cmd, timeout=300, cwd=folder, check=check, env=env)


def test_make_ray_trains_on_a_cluster_it_starts_and_stops(uninterrupted):
    text, snapshot = uninterrupted
    log = log_of(text)
    log.assert_trained(world_size=NPROC, factor=10)
    assert log.epochs == list(range(1, EPOCHS + 1))
    assert sorted(log.ranks) == list(range(NPROC)) and log.backend == "gloo", text[-3000:]
    assert log.text.count(f"epoch {EPOCHS}/{EPOCHS} |") == 1, "each line once: Ray Train's print patch is off"
    assert "\x1b[" not in text, "no colour codes in output that goes to a pipe"
    head = HEAD_RE.search(text).group(1)
    assert f"Ray head at {head} stopped" in text
    assert not leftovers(text)
    state = load_snapshot(snapshot)
    assert set(state) == {"MODEL_STATE", "OPTIMIZER_STATE", "EPOCHS_RUN"} and state["EPOCHS_RUN"] == EPOCHS
    assert set(state["MODEL_STATE"]) == {"weight", "bias"} and state["OPTIMIZER_STATE"]["state"]


def test_ray_equals_single_process_with_the_global_batch(uninterrupted, single_gpu_reference):
    """2 Ray workers with batch 32 take the steps of single_gpu.py with batch 64 (the session's reference
    run, which tests/lessons/test_examples.py compares the other launchers with)."""
    text, snapshot = uninterrupted
    folder, proc = single_gpu_reference
    assert (EPOCHS, BATCH * NPROC, COMMON) == (REFERENCE_EPOCHS, REFERENCE_BATCH, REFERENCE_ARGS)
    expected = load_snapshot(folder / "single_gpu_snapshot.pt")["MODEL_STATE"]
    for key, tensor in load_snapshot(snapshot)["MODEL_STATE"].items():
        torch.testing.assert_close(tensor, expected[key], rtol=1e-5, atol=1e-6)
    assert log_of(text).losses == pytest.approx(TrainLog(proc.stdout).losses, rel=1e-4)


def test_a_stopped_run_resumes_to_the_bits_of_an_uninterrupted_one(cluster, uninterrupted, tmp_path):
    """A Ray run stopped after 2 epochs and run again ends on the uninterrupted run's bits.

    The first run is `python multigpu_ray.py 4 2` with no --address, no RAY_ADDRESS and no cluster: as
    ray.init() does, a Ray cluster starts on this machine for the run and is gone when the script ends. The
    second joins the session's cluster, named by RAY_ADDRESS. Over a minute: it waits for the session's
    cluster and its uninterrupted run, then trains twice, starting a cluster for the first (60 s in a whole
    run)."""
    text, snapshot = uninterrupted
    args = ["--batch_size", BATCH, "--nproc", NPROC, *COMMON]
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # its own: no cluster started before is found
    try:  # (a short path: Ray's socket names must fit in 107 bytes)
        alone = {"RAY_ADDRESS": "", "RAY_TMPDIR": ray_tmp, "HOME": ray_tmp}  # HOME: ~/.ray's token there too
        first = train(tmp_path, 2, 2, *args, address=None, env=alone)
        assert "Started a local Ray instance" in first.stdout, first.stdout[-3000:]
        assert log_of(first.stdout).epochs == [1, 2] and sorted(log_of(first.stdout).ranks) == list(
            range(NPROC)
        )
        assert not leftovers(first.stdout, folder=ray_tmp)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    second = train(tmp_path, EPOCHS, 2, *args, address=None, env={"RAY_ADDRESS": cluster.address})
    assert "Started a local Ray instance" not in second.stdout, "RAY_ADDRESS names the cluster to join"
    resumed = log_of(second.stdout)
    assert "resuming from multigpu_ray_snapshot.pt: 2 epochs already run" in resumed.text
    assert resumed.epochs == [3, 4] and resumed.losses == log_of(text).losses[2:]
    for part in ("MODEL_STATE", "OPTIMIZER_STATE"):  # bit for bit, momentum buffers included
        ours, theirs = (
            load_snapshot(tmp_path / "multigpu_ray_snapshot.pt")[part],
            load_snapshot(snapshot)[part],
        )
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    # the workers ran in the driver's folder: the relative paths landed here, and nothing else did
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["multigpu_ray.py", "multigpu_ray_snapshot.pt"]


def test_more_workers_than_the_cluster_can_place_are_refused(cluster, tmp_path):
    proc = train(tmp_path, 2, 1, "--nproc", NPROC + 1, address=cluster.address, check=False)
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert f"error: --nproc {NPROC + 1}: the Ray cluster has {NPROC} CPUs" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["multigpu_ray.py"], "nothing written"


def silent_port():
    """A listening socket whose queue is full: connections to it go unanswered, as to a host that is down."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    queued = []
    for _ in range(3):
        client = socket.socket()
        client.setblocking(False)
        client.connect_ex(server.getsockname())
        queued.append(client)
    return server, queued


def test_an_unreachable_address_is_named_after_the_timeout(tmp_path):
    server, queued = silent_port()
    address = f"127.0.0.1:{server.getsockname()[1]}"
    try:
        proc = train(tmp_path, 2, 1, "--timeout", 3, address=address, check=False)
    finally:
        for sock in [server, *queued]:
            sock.close()
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert f"error: no Ray cluster answers at {address} (timed out)" in proc.stdout, proc.stdout[-3000:]
    assert "ray start --head" in proc.stdout


def test_a_refused_address_is_named_at_once(tmp_path):
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    proc = train(tmp_path, 2, 1, "--timeout", 600, address=None, env={"RAY_ADDRESS": address}, check=False)
    assert proc.returncode == 2 and f"no Ray cluster answers at {address} (" in proc.stdout, proc.stdout
    assert "Connection refused" in proc.stdout


def test_make_ray_stops_its_cluster_when_the_run_fails(tmp_path):
    """The training command fails (here bad input, once the cluster is up): the cluster is stopped all the
    same and make exits non-zero."""
    make = ["make", "-C", REPO, "ray", "EPOCHS=2", f"RUNS={tmp_path}", f"VENV={VENV}", "NPROC=2"]
    proc = run([*make, "ARGS=--lr -1"], timeout=300, check=False)
    assert proc.returncode != 0
    assert "error: lr must be positive and finite, got -1.0" in proc.stdout, proc.stdout
    assert re.search(r"^Ray head at \S+ stopped", proc.stdout, re.M)
    assert not leftovers(proc.stdout)
