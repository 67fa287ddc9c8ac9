"""The Docker image and the two-node Compose files (compose.yaml at the root, compose/) run for real: the
image's contents, make's rebuilds, plain `docker compose up`, uneven nodes over a shaped link, the
accelerate, Ray and GPT variants, two machines on the host network, a paused or lost node, the failover and
torchft demos. The files read without a daemon are test_compose_files.py's.

These need a Docker daemon and the Compose client, `docker compose` v2.20 or later
(docker/install-compose.sh installs the pinned one), and skip when missing, unless REQUIRE_DOCKER=1.
Budget: under 20 min on 2 cores shared with other jobs (19.5 min measured at a load of 7-9; plain `up`
twice 5 min; the node-failure test, `make two-node-failover --crash`, 100 s at a load of 3 and 5.6 min
beside another suite's run, where the by-hand test it replaced took 7 min), with the image cached (a cold
image build adds about 8 min).
"""

import fcntl
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from helpers import (
    EPOCH_RE,
    REPO,
    RUN_ID,
    TrainLog,
    assert_world,
    free_port,
    need,
    run,
    wait_for_json,
    without_ray_prefixes,
)
from test_compose_files import (
    BASE_IMAGE,
    CPU,
    SNAPSHOTS,
    VARIANTS,
    compose,
    compose_args,
    resolved,
)

pytestmark = pytest.mark.docker

__all__ = ["compose"]  # the Compose client fixture of test_compose_files.py

# This run's tags (two runs on one machine must not retag each other's images); at the end of the session
# each moves to its lasting tag, which keeps the layers cached for the next run, so no tag is left per run.
LASTING = {f"ddp-examples:test-{RUN_ID}": "ddp-examples:test", f"ddp-shaper:test-{RUN_ID}": "ddp-shaper:test"}
IMAGE, SHAPER_IMAGE = LASTING
EPOCHS, SAVE_EVERY = 4, 2
PREFIX_RE = re.compile(r"^[\w-]+\s+\| ", re.M)  # `node0-1  | ` before each line of `up`'s output


def succeeds(cmd, timeout=30):
    try:
        return subprocess.run(cmd, capture_output=True, timeout=timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def docker_daemon():
    return bool(shutil.which("docker")) and succeeds(["docker", "info"])


@pytest.fixture(scope="session")
def image(compose):
    """The project image, built on a base made offline by docker/build-base.sh (no registry needed)."""
    need(docker_daemon(), "no reachable Docker daemon (docker/start-daemon.sh starts one)", "REQUIRE_DOCKER")
    start = time.monotonic()
    with open(Path(tempfile.gettempdir()) / "ddp-image-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # .ci/run's build of the same images, if one runs, has ended
    waited = time.monotonic()
    run([REPO / "docker" / "build-base.sh", BASE_IMAGE], timeout=900)
    based = time.monotonic()
    run(["docker", "build", "-q", "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", "-t", IMAGE, REPO], timeout=1800)
    size = run(["docker", "image", "inspect", "-f", "{{.Size}}", IMAGE], timeout=60).stdout.strip()
    print(
        f"waited {waited - start:.0f} s for .ci/run's build, base image {based - waited:.0f} s, "
        f"project image {time.monotonic() - based:.0f} s, "
        f"{int(size) / 1e9:.2f} GB"
    )
    yield IMAGE
    for tag, lasting in LASTING.items():
        if run(["docker", "tag", tag, lasting], timeout=60, check=False).returncode == 0:
            run(["docker", "image", "rm", tag], timeout=120, check=False)


@pytest.fixture(scope="session")
def ray_image(image):
    """The image's ray target (compose/ray.yaml): the project image's layers plus the ray pins."""
    tag = IMAGE.replace("ddp-examples", "ddp-examples-ray")
    build = ["docker", "build", "-q", "--target", "ray", "--build-arg", f"BASE_IMAGE={BASE_IMAGE}"]
    run([*build, "-t", tag, REPO], timeout=1800)
    return tag


class ComposeProject:
    """One Compose project (containers, network, snapshot volume) with a unique name, removed at the end."""

    def __init__(self, compose, name, files, **variables):
        self.name = name
        self.cmd = [*compose, "-p", name, *compose_args(files)]
        self.env = {k: str(v) for k, v in variables.items()}

    def __call__(self, *args, timeout=120, check=True):
        return run([*self.cmd, *args], timeout=timeout, check=check, env=self.env, cwd=REPO)

    def up(self, *args, timeout=600):
        """Run both nodes to the end; the exit status is node0's."""
        start = time.monotonic()
        proc = self(
            "up",
            "--abort-on-container-exit",
            "--exit-code-from",
            "node0",
            *args,
            timeout=timeout,
            check=False,
        )
        return proc, time.monotonic() - start

    def container(self, service):
        ids = self("ps", "-a", "-q", service).stdout.split()
        assert ids, f"no container for {service}"
        return ids[0]

    def logs(self, service):
        """What the service printed, without Compose's prefixes."""
        return run(["docker", "logs", self.container(service)], timeout=60).stdout

    def copy_out(self, path, service="node1"):
        """A folder on this machine holding a copy of path (a file or a folder on the shared volume), taken
        out of the service's container with docker cp: no container started (nor torch imported) to read
        it, and the container may have stopped."""
        folder = Path(tempfile.mkdtemp(prefix="ddp-volume-"))
        run(["docker", "cp", f"{self.container(service)}:{path}", folder], timeout=120)
        return folder / Path(path).name

    def snapshot(self, path):
        """The snapshot file at path on the shared volume, as torch loads it."""
        copied = self.copy_out(path)
        try:
            return torch.load(copied, map_location="cpu", weights_only=True)
        finally:
            shutil.rmtree(copied.parent)

    def snapshot_epochs(self, path):
        """EPOCHS_RUN of the snapshot at path on the shared volume."""
        return self.snapshot(path)["EPOCHS_RUN"]

    def down(self):
        self("--profile", "shaped", "down", "--volumes", "--remove-orphans", "--timeout", "5", check=False)


@pytest.fixture
def project(compose, image, request):
    """Makes Compose projects for a test; every one is torn down afterwards, even on failure."""
    made = []

    def make(files, **variables):
        name = f"ddptest{RUN_ID}{len(made)}"
        variables = {"DDP_IMAGE": image, "EPOCHS": EPOCHS, "SAVE_EVERY": SAVE_EVERY, **variables}
        proj = ComposeProject(compose, name, files, **variables)
        made.append(proj)
        proj.down()
        return proj

    yield make
    for proj in made:
        proj.down()


def test_image_runs_as_a_non_root_user_without_secrets(image):
    user = run(["docker", "image", "inspect", "-f", "{{.Config.User}}", image], timeout=60).stdout.strip()
    assert user not in ("", "root", "0"), user
    uid = run(["docker", "run", "--rm", "--entrypoint", "id", image, "-u"], timeout=120).stdout.split()[-1]
    assert uid != "0"
    env = run(["docker", "image", "inspect", "-f", "{{json .Config.Env}}", image], timeout=60).stdout
    names = [item.split("=", 1)[0] for item in json.loads(env)]
    assert not [n for n in names if re.search(r"TOKEN|SECRET|PASSWORD|API_KEY|CREDENTIAL", n)], names


def inputs_sum(image):
    """The checksum of its inputs that the image carries (the Dockerfile's stage inputs)."""
    cat = ["docker", "run", "--rm", "--network", "none", "--entrypoint", "cat", image, "/app/.image-inputs"]
    return run(cat, timeout=60).stdout.strip()


def test_make_builds_the_image_only_when_it_is_missing_or_out_of_date(image):
    """`make two-node-cpu` on a machine without a registry: an image already there is run, not rebuilt (a
    rebuild would ask the registry for the CUDA base and fail); changed inputs rebuild it on its own base."""
    tag = f"{IMAGE}-current"
    make = ["make", "--no-print-directory", "-C", REPO, "image-current", f"IMAGE={tag}"]
    try:
        first = run([*make, f"BASE_IMAGE={BASE_IMAGE}"], timeout=1800).stdout
        assert f"{tag} is missing: building it on {BASE_IMAGE}" in first, first[-2000:]
        again = run(make, timeout=120).stdout  # no BASE_IMAGE: any base does, as for `docker compose up`
        assert (
            again.strip() == f"{tag} is up to date (built from these files on base {BASE_IMAGE}): not rebuilt"
        )
        changed = run([*make, "IMAGE_SUM=0123456789abcdef"], timeout=1800).stdout  # as if an example changed
        assert f"{tag} is out of date: building it on {BASE_IMAGE}" in changed, changed[-2000:]
        assert inputs_sum(tag) == run([REPO / "docker" / "image-inputs.sh", REPO], timeout=60).stdout.strip()
    finally:
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True, timeout=120, check=False)


def test_a_base_no_registry_holds_stops_make_in_one_line_before_any_build():
    """Without a registry, a build on the CUDA base fails at FROM with Docker's raw error, under make's Error
    lines from a sub-make. make says instead, in one line, how to build the base offline, before `docker
    build` starts. Checked with a base that no registry holds, so that it holds with a registry too."""
    need(docker_daemon(), "no reachable Docker daemon (docker/start-daemon.sh starts one)", "REQUIRE_DOCKER")
    base, image = f"local/no-such-base:{RUN_ID}", f"ddp-examples:no-such-image-{RUN_ID}"
    cmd = ["make", "--no-print-directory", "-C", REPO, "two-node-cpu", f"IMAGE={image}", f"BASE_IMAGE={base}"]
    proc = run(cmd, timeout=120, check=False)
    said = f"cannot pull {base} (no registry reachable?): build the base offline: make base-image, then "
    said += "make two-node-cpu BASE_IMAGE=local/ddp-base:bookworm"
    lines = proc.stdout.splitlines()
    assert proc.returncode != 0 and len(lines) == 2 and lines[0] == said, proc.stdout[-3000:]
    assert re.fullmatch(r"make: \*\*\* \[Makefile:\d+: image-current\] Error 1", lines[1]), lines


# The image every node pulls: the runtime pins only, no developer tools, nothing compiled or written at start.
DEV_TOOLS = ["pytest", "ruff", "kubectl", "hadolint", "shellcheck", "uv"]
NOT_IN_IMAGE = ["pytest", "ruff", "ray", "matplotlib", "kubernetes_validate"]  # Python packages
TORCHRUN2 = "torchrun --standalone --nproc-per-node=2"
GPT_TINY = "--n_layer 2 --n_head 2 --n_embd 64 --block_size 64 --eval_samples 32 --sample_chars 0"
IN_IMAGE = {  # each lesson for 1 epoch and the GPT trainer for 4 steps, what each prints when it ends well
    "examples/single_gpu.py 1 1": "epoch 1/1 |",
    "examples/multigpu.py 1 1 --nproc 2": "| world_size 2",
    "examples/multigpu_dataparallel.py --help": "usage: multigpu_dataparallel.py",  # needs 2 GPUs to train
    f"{TORCHRUN2} examples/multigpu_torchrun.py 1 1": "| world_size 2",
    f"{TORCHRUN2} examples/multinode.py 1 1": "| world_size 2",
    f"{TORCHRUN2} examples/multigpu_accelerate.py 1 1": "| world_size 2",
    f"{TORCHRUN2} examples/gpt/train.py --max_steps 4 {GPT_TINY}": "replicas identical: 2 copies",
}


def test_the_image_holds_no_developer_tools(image):
    script = f"for t in {' '.join(DEV_TOOLS)}; do command -v $t; done; python -c " + repr(
        f"import importlib.util as u; print(*[m for m in {NOT_IN_IMAGE} if u.find_spec(m)])"
    )
    found = run(["docker", "run", "--rm", "--entrypoint", "bash", image, "-c", script], timeout=120).stdout
    assert not found.split(), f"in the image: {found}"


def test_every_lesson_and_the_gpt_run_in_the_image_from_bytecode(image):
    """Every lesson and the GPT trainer run in the image from its bytecode.

    Each lesson (Ray's has its own image) and the GPT trainer train in the image; Python loads
    the venv's and the examples' bytecode compiled at build time, and no process writes into the venv.

    Over a minute: every lesson, one after another, in one container (80 s in a whole run)."""
    name = f"ddp-lessons-{os.getpid()}"
    script = "set -e; " + "".join(f"echo '>>> {cmd}'; python {cmd}; " for cmd in IN_IMAGE).replace(
        "python torchrun", "torchrun"
    )
    imports = "import sys; sys.path[:0] = ['examples/gpt']; import torchvision, accelerate, train"
    script += f"echo '>>> loaded'; python -v -c {imports!r} 2>&1 | grep '^# code object from'"
    try:
        proc = run(["docker", "run", "--name", name, "--entrypoint", "bash", image, "-c", script],
                   timeout=900, check=False)  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-4000:]
        for cmd, done in IN_IMAGE.items():
            part = proc.stdout.split(f">>> {cmd}\n", 1)[1].split(">>> ", 1)[0]
            assert done in part, f"{cmd}:\n{part[-2000:]}"
        changed = run(["docker", "diff", name], timeout=60).stdout.split("\n")
        assert not [line for line in changed if "/opt/venv" in line], changed
    finally:
        run(["docker", "rm", "-f", name], timeout=60, check=False)
    loaded = proc.stdout.split(">>> loaded\n", 1)[1]
    from_source = re.findall(r"code object from '?(/(?:opt/venv|app)/\S+\.py)'?$", loaded, re.M)
    assert len(re.findall(r"\.pyc'?$", loaded, re.M)) > 1000 and not from_source, from_source[:20]


def test_the_image_carries_the_rdma_userspace_nccl_loads(image):
    """libibverbs (NCCL opens libibverbs.so.1 for InfiniBand and RoCE), the adapters' providers, librdmacm,
    and ibv_devinfo to list the adapters."""
    code = "import ctypes; ctypes.CDLL('libibverbs.so.1'); ctypes.CDLL('librdmacm.so.1'); print('loaded')"
    script = f"python -c {code!r} && ls /usr/lib/*/libibverbs/ && command -v ibv_devinfo"
    out = run(["docker", "run", "--rm", "--entrypoint", "bash", image, "-c", script], timeout=120).stdout
    assert "loaded" in out and "libmlx5" in out and "ibv_devinfo" in out, out


# Real runs: the first one also waits for the image build (minutes on a cold machine).
SLOW = pytest.mark.timeout(1800)


def epochs_in(up_output):
    """Epoch numbers in the output of `docker compose up`, its `node0-1  | ` prefixes removed."""
    return [int(epoch) for epoch, *_ in EPOCH_RE.findall(PREFIX_RE.sub("", up_output))]


@SLOW
def test_plain_up_at_the_root_builds_the_image_and_trains(project, compose):
    """What a new user types: `docker compose up` at the root, no flags. A missing image is built (from the
    layers the image fixture cached, on the local base); both nodes train to the end on CPUs and exit 0.
    The second run is make's way on compose's image, offline: `make two-node-cpu` finds it up to date (the
    checksum of its inputs that the Dockerfile wrote into it is the working tree's, its base label the one
    given) and runs it without a build (one would fail here, with no registry). Its `docker compose up`
    resumes from the snapshot on the volume: that holds every epoch already, so nothing trains."""
    tag = f"ddp-examples:test-up-{RUN_ID}"
    proj = project((), DDP_IMAGE=tag, BASE_IMAGE=BASE_IMAGE)
    proj.cmd = [*compose, "-p", proj.name]  # no -f: the root's compose.yaml, as Compose finds it
    try:
        first = proj("up", timeout=900, check=False)
        statuses = proj("ps", "-a", "--format", "{{.Service}}={{.ExitCode}}").stdout.split()
        assert first.returncode == 0 and sorted(statuses) == ["node0=0", "node1=0"], first.stdout[-6000:]
        assert f"{tag} Built" in first.stdout or "Successfully tagged" in first.stdout, first.stdout[-3000:]
        assert epochs_in(first.stdout) == list(range(1, EPOCHS + 1)), first.stdout[-3000:]
        TrainLog(proj.logs("node0")).assert_trained(world_size=4)
        assert_world(proj.logs("node0") + proj.logs("node1"), {"node0": 2, "node1": 2})

        cmd = ["make", "--no-print-directory", "-C", REPO, "two-node-cpu", f"IMAGE={tag}", f"EPOCHS={EPOCHS}"]
        cmd += [f"SAVE_EVERY={SAVE_EVERY}", f"COMPOSE={' '.join(compose)} -p {proj.name}"]
        again = run(cmd, timeout=300, check=False, env=proj.env)
        assert again.returncode == 0, again.stdout[-3000:]
        up_to_date = f"{tag} is up to date (built from these files on base {BASE_IMAGE}): not rebuilt\n"
        assert again.stdout.startswith(up_to_date), again.stdout[-3000:]
        assert "docker build" not in again.stdout and epochs_in(again.stdout) == [], again.stdout[-3000:]
    finally:
        proj.down()
        run(["docker", "image", "rm", tag], timeout=120, check=False)


@SLOW
def test_uneven_nodes_over_a_shaped_link(project, image):
    """node0 with 2 processes, node1 with 1, over a link shaped to 100 Mbit/s with 5 ms of delay asked
    for: a world of 3 with consistent ranks, rank 0's last epoch at world_size 3. The helpers shape each
    node's egress (tc htb, seen carrying the job's traffic); without netem in the kernel the delay is
    refused with a warning and the job still runs."""
    proj = project(
        CPU,
        NODE0_NPROC=2,
        NODE1_NPROC=1,
        LINK_RATE="100mbit",
        LINK_DELAY="5ms",
        BASE_IMAGE=BASE_IMAGE,
        SHAPER_IMAGE=SHAPER_IMAGE,
        EPOCHS=6,
    )
    proj("--profile", "shaped", "up", "-d", "--build", timeout=900)
    node0 = proj.container("node0")
    deadline = time.monotonic() + 300
    while not EPOCH_RE.search(proj.logs("node0")):
        assert time.monotonic() < deadline, f"no epoch within 300 s:\n{proj.logs('node0')[-3000:]}"
        time.sleep(0.5)
    classes = {
        h: proj("exec", "-T", h, "tc", "-s", "class", "show", "dev", "eth0").stdout
        for h in ("shape0", "shape1")
    }
    status = run(["docker", "wait", node0], timeout=600).stdout.strip()
    text = proj.logs("node0") + proj.logs("node1")
    assert status == "0", text[-4000:]
    TrainLog(proj.logs("node0")).assert_trained(world_size=3)
    assert_world(text, {"node0": 2, "node1": 1})
    for helper, stats in classes.items():
        assert re.search(r"rate 100Mbit ceil 100Mbit", stats), stats
        sent = re.search(r"Sent (\d+) bytes", stats)
        assert sent and int(sent.group(1)) > 100_000, stats
        says = proj.logs(helper)
        assert "eth0 egress shaped: rate 100mbit" in says, says
        assert ("shaped: rate 100mbit, delay 5ms" in says) != ("no netem qdisc" in says), says


@SLOW
def test_accelerate_across_two_containers(project):
    proj = project(VARIANTS["accelerate-cpu"])
    proc, seconds = proj.up()
    print(f"accelerate-cpu: compose run {seconds:.0f} s")
    assert proc.returncode == 0, proc.stdout[-6000:]
    TrainLog(proj.logs("node0")).assert_trained(world_size=4)
    assert proj.snapshot_epochs(SNAPSHOTS["accelerate"]) == EPOCHS


def test_ray_variant_runs_the_ray_example_on_a_head_and_a_worker_node(compose):
    """node0 hosts the Ray head and the driver, with one worker per CPU of both nodes; node1 joins it."""
    services = resolved(compose, VARIANTS["ray-cpu"], env={"NODE0_NPROC": "3", "NODE1_NPROC": "1"})[
        "services"
    ]
    node0, node1 = services["node0"], services["node1"]
    assert node0["build"]["target"] == "ray" and node0["image"] == node1["image"] == "ddp-examples-ray:latest"
    assert node0["entrypoint"] == ["tools/ray-node.sh", "head"]
    assert node0["command"][0] == "examples/multigpu_ray.py"
    assert f"--snapshot_path={SNAPSHOTS['ray']}" in node0["command"]
    assert (node0["environment"]["NODE_CPUS"], node0["environment"]["PEER_CPUS"]) == ("3", "1")
    assert node1["entrypoint"] == ["tools/ray-node.sh", "worker", "node0:6379"] and not node1["command"]
    assert node1["environment"]["NODE_CPUS"] == "1"


def test_gpt_variant_runs_the_gpt_trainer(compose):
    for service in resolved(compose, VARIANTS["gpt-cpu"])["services"].values():
        assert service["command"][0] == "examples/gpt/train.py"
        assert f"--snapshot_path={SNAPSHOTS['gpt']}" in service["command"]


@SLOW
def test_ray_across_two_containers(project, ray_image):
    """Plain `up` with compose/ray.yaml: a Ray head on node0 and a worker node on node1 train with 2 workers
    each; when training ends both containers exit, with status 0, none left waiting.

    Over a minute: a Ray cluster across two containers starts, trains and stops (60 s in a whole run)."""
    proj = project(VARIANTS["ray-cpu"], DDP_RAY_IMAGE=ray_image)
    start = time.monotonic()
    proc = proj("up", timeout=900, check=False)
    print(f"ray-cpu: compose run {time.monotonic() - start:.0f} s")
    statuses = proj("ps", "-a", "--format", "{{.Service}}={{.ExitCode}}").stdout.split()
    assert proc.returncode == 0 and sorted(statuses) == ["node0=0", "node1=0"], proc.stdout[-6000:]
    text = without_ray_prefixes(proj.logs("node0"))
    TrainLog(text).assert_trained(world_size=4)
    assert epochs_in(text) == list(range(1, EPOCHS + 1))
    # Ray Train placed two workers on each node (node_rank 0 and 1)
    placed = re.findall(r"world_rank=(\d+), local_rank=(\d+), node_rank=(\d+)", text)
    assert sorted(node for *_, node in placed) == ["0", "0", "1", "1"], text[-3000:]
    assert "the Ray head at node0:6379 has stopped: leaving" in proj.logs("node1")
    assert proj.snapshot_epochs(SNAPSHOTS["ray"]) == EPOCHS


TWO_MACHINES = "<!-- tests/deploy/test_docker.py runs the next block on this machine"


@SLOW
def test_the_two_machines_command_of_docker_md_trains_two_nodes(image, tmp_path):
    """The two machines command of docs/docker.md trains two nodes over the host network.

    docs/docker.md's per-machine `docker run`, as its comment says: both containers on this machine's
    host network, node 0 at 127.0.0.1 over the loopback interface, no --gpus, 2 processes a node and 2
    epochs, a folder of this test as the shared one. Both end 0; node 0 logs 4 ranks across the 2 nodes
    and the shared snapshot holds both epochs. Mutation: --network host left out: each container's
    127.0.0.1 is its own, node 1 never meets node 0, and the test fails."""
    text = (REPO / "docs" / "docker.md").read_text()
    block = text.split(TWO_MACHINES, 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    command = block.replace("\\\n", " ").split()
    port = free_port()
    shared = tmp_path / "snapshots"
    shared.mkdir()
    shared.chmod(0o777)  # the image's user writes there
    swap = {
        "--gpus": None,
        "all": None,
        "NCCL_SOCKET_IFNAME=IFACE": "NCCL_SOCKET_IFNAME=lo",
        "GLOO_SOCKET_IFNAME=IFACE": "GLOO_SOCKET_IFNAME=lo",
        "/shared/snapshots:/snapshots": f"{shared}:/snapshots",
        "ddp-examples:latest": image,
        "--nproc-per-node=8": "--nproc-per-node=2",
        "--rdzv-endpoint=NODE0:29500": f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=job1": f"--rdzv-id=test{port}",
        "50": "2",
        "10": "1",
    }
    command = [swap.get(word, word) for word in command]
    command = [word for word in command if word is not None]
    assert command[:3] == ["docker", "run", "--rm"] and "--network" in command, command
    names = [f"ddptest{RUN_ID}host{node}" for node in (0, 1)]
    # One machine here, where two machines differ: both containers share its network, so both would take
    # 127.0.0.1 for their own and host the rendezvous store (node 1 is told it does not), and its name,
    # which with the pid (1 in each container) names a node to the rendezvous (--pid=host: pids differ).
    script = command.index("examples/multinode.py")
    not_host = ["--rdzv-conf=is_host=false"]
    procs = [
        subprocess.Popen(
            [*command[:3], "--name", name, "--pid=host", *command[3:script], *not_host[:node],
             *command[script:]],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node, name in enumerate(names)
    ]  # fmt: skip
    try:
        outs = [proc.communicate(timeout=600)[0] for proc in procs]
    finally:
        for name in names:
            subprocess.run(["docker", "rm", "-f", name], capture_output=True, check=False)
    assert [proc.returncode for proc in procs] == [0, 0], outs
    logs = [TrainLog(out) for out in outs]
    trained = [log for log in logs if log.epochs]
    assert len(trained) == 1, outs  # global rank 0 logs, on whichever node it landed
    trained[0].assert_trained(world_size=4)
    nodes = {place[4] for log in logs for place in log.ranks.values()}
    assert nodes == {"0", "1"}, outs
    assert (shared / "multinode.pt").is_file()


@SLOW
def test_gpt_across_two_containers(project):
    proj = project(VARIANTS["gpt-cpu"], GPT_STEPS=20, GPT_SAVE_EVERY=10)
    proc, seconds = proj.up()
    print(f"gpt-cpu: compose run {seconds:.0f} s")
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert "replicas identical: 4 copies" in proj.logs("node0"), proj.logs("node0")[-3000:]
    snapshot = SNAPSHOTS["gpt"]  # a directory: PATH/latest names the newest complete step's folder
    copied = proj.copy_out(snapshot)
    newest = copied / (copied / "latest").read_text().strip()
    assert torch.load(newest / "extra.pt", weights_only=True)["step"] == 20
    # the run's metrics on the volume, served by the tensorboard profile's container
    metrics = proj.copy_out(METRICS)
    logged = [json.loads(line) for line in metrics.read_text().splitlines() if line.startswith("{")]
    shutil.rmtree(copied.parent)
    shutil.rmtree(metrics.parent)
    losses = {r["step"]: r["loss"] for r in logged if "loss" in r}
    assert sorted(losses) == list(range(10, 21, 10)), logged  # the preset's log line every 10 steps
    port = proj.env["TENSORBOARD_PORT"] = str(free_port())
    try:
        proj("--profile", "tensorboard", "up", "-d", "tensorboard", timeout=120)
        url = f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?run=.&tag=train%2Floss"
        served = wait_for_json(url, len(losses), limit=120)
        assert {step: value for _, step, value in served} == pytest.approx(losses, rel=1e-6)
    finally:  # before the fixture removes the volume it reads
        proj("--profile", "tensorboard", "rm", "--stop", "--force", "tensorboard", check=False)


METRICS = "/snapshots/gpt-metrics/metrics.jsonl"


@SLOW
def test_a_paused_node_is_named_by_the_hang_report(project):
    """node1 freezes mid-run (its processes stopped with SIGSTOP, as `docker compose pause` does through the
    cgroup freezer, which can fail on a busy host): node0's processes wait --dist_timeout, dump their stacks
    on the shared volume, and the report, run as the compose file says, names node1's processes as silent.

    Over a minute: the job starts, node1 is paused, node0 waits its --dist_timeout and dumps (70 s)."""
    proj = project(VARIANTS["gpt-cpu"], GPT_STEPS=2000, GPT_SAVE_EVERY=1000, GPT_DIST_TIMEOUT=15)
    proj("up", "-d")
    deadline = time.monotonic() + 300
    while not re.search(r"^step 10/", proj.logs("node0"), re.M):  # training, both nodes in it
        assert time.monotonic() < deadline, proj.logs("node0")[-3000:]
        time.sleep(1)
    proj("exec", "-T", "node1", "sh", "-c", "kill -STOP -1")  # all but its PID 1, torchrun's agent
    try:
        deadline = time.monotonic() + 180
        while "make why-hung RUN=/snapshots/gpt" not in proj.logs("node0"):
            assert time.monotonic() < deadline, proj.logs("node0")[-3000:]
            time.sleep(1)
        report = proj(*WHY_HUNG, timeout=120).stdout.splitlines()
    finally:
        proj("exec", "-T", "node1", "sh", "-c", "kill -CONT -1", check=False)
    dumped = [line for line in report if re.match(r"rank \d \(node\d, pid \d+\)", line)]
    assert len(dumped) == 2 and all("(node0, pid" in line for line in dumped), report  # node0's 2 processes
    silent = [line for line in report if re.match(r"rank \d: wrote nothing", line)]
    assert len(silent) == 2, report  # node1's 2 processes, paused
    assert "wrote nothing (stopped, dead or unreachable" in report[-1], report


# the report, as compose/gpt.yaml says to run it
WHY_HUNG = ["run", "--rm", "--no-deps", "--entrypoint", "python", "node0", "tools/why_hung.py"]
WHY_HUNG += ["/snapshots/gpt"]


@SLOW
def test_a_missing_node_fails_the_run_in_bounded_time(project):
    """node1 never starts: node0 gives up after the rendezvous join timeout, and `up` exits non-zero."""
    proj = project(CPU, JOIN_TIMEOUT=20)
    proc, seconds = proj.up("--scale", "node1=0", timeout=300)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "RendezvousTimeoutError" in proc.stdout, proc.stdout[-3000:]
    assert "not all 2 node(s) joined the rendezvous at node0:29500 within join_timeout (20 s)" in proc.stdout
    assert "Usual causes" in proc.stdout
    assert seconds < 120


FAILOVER_EPOCHS, FAILOVER_SAVE_EVERY = 20, 4  # of the demo's 40 and 5: two failures still fit, mid-run
ACCOUNT_RE = {  # the account `make two-node-failover` ends with, line by line
    "crash": r"node1's main process \(pid \d+\) was killed \(SIGKILL\) in epoch (\d+), after the snapshot of "
    r"epoch (\d+); Docker restarted the container itself",
    "kill": r"node1 was killed \(docker kill\) in epoch (\d+), after the snapshot of epoch (\d+); "
    r"docker compose start node1 brought it back",
    "resumed": r"node0's torchrun restarted its processes; the nodes met again and resumed (\d) time\(s\), "
    r"from the snapshot of epoch (\d+(?:, then \d+)*)",
    "end": rf"the job exited 0 at epoch {FAILOVER_EPOCHS}/{FAILOVER_EPOCHS}, world_size 4",
    "same": r"final weights equal an uninterrupted run's, bit for bit",
}


@SLOW
def test_make_two_node_failover_shows_node1_lost_and_the_job_recovering(project, image):
    """`make two-node-failover`: node1 fails mid-training and comes back, the job resumes from the snapshot
    and ends with the weights of an uninterrupted run, and the account says so. As root, node1's main
    process dies first (a crash, or the OOM killer): Docker restarts the container by itself
    (compose/elastic.yaml); then `docker kill node1`, which Docker treats as a deliberate stop, and
    `compose start node1`. Each time torchrun restarts node0's processes and both nodes meet again.

    Over a minute: two failures, each a container restarted and a new rendezvous, then an uninterrupted
    run to compare with (100 s in a whole run at the demo's 40 epochs; here 20)."""
    crash = os.geteuid() == 0  # killing a container's process from the host needs root
    job, reference = project(VARIANTS["elastic-cpu"]), project(CPU)  # names of this run, removed after
    options = f"--project {job.name} --reference_project {reference.name}" + (" --crash" if crash else "")
    options += f" --epochs {FAILOVER_EPOCHS} --save_every {FAILOVER_SAVE_EVERY}"
    make = ["make", "--no-print-directory", "-C", REPO, "two-node-failover", f"IMAGE={image}"]
    make += [f"BASE_IMAGE={BASE_IMAGE}", f"FAILOVER_ARGS={options}"]
    start = time.monotonic()
    proc = run(make, timeout=1500, check=False)
    print(f"make two-node-failover{' --crash' if crash else ''}: {time.monotonic() - start:.0f} s")
    out = proc.stdout
    assert proc.returncode == 0, out[-5000:]
    account = out.split("two-node failover, in short:\n", 1)[1].splitlines()
    failures = ["crash", "kill"] if crash else ["kill"]
    assert len(account) == len(failures) + 3, account
    saved = []
    for line, how in zip(account, failures, strict=False):
        found = re.fullmatch(r"\s+" + ACCOUNT_RE[how], line)
        assert found, line
        epoch, snapshot = map(int, found.groups())
        assert epoch > snapshot > 0 and snapshot % FAILOVER_SAVE_EVERY == 0, line  # after a snapshot, mid-run
        saved.append(snapshot)
    resumed = re.fullmatch(r"\s+" + ACCOUNT_RE["resumed"], account[-3])
    assert resumed and int(resumed.group(1)) == len(failures), account[-3]
    assert [int(e) for e in resumed.group(2).split(", then ")] == saved, account  # from that snapshot
    assert re.fullmatch(r"\s+" + ACCOUNT_RE["end"], account[-2]), account[-2]
    assert re.fullmatch(r"\s+" + ACCOUNT_RE["same"], account[-1]), account[-1]
    assert "frame #" not in out and "\x1b[" not in out, "C++ frames or terminal codes in the output"
    # the run's own lines came before the account, and both projects are gone
    assert "resuming from /snapshots/multinode.pt" in out.split("two-node failover, in short:")[0]
    left = run(
        ["docker", "ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={job.name}"], timeout=60
    )
    assert not left.stdout.strip(), left.stdout


# of the demo's 40 by default. node1 is killed after epoch 5 and started after 7; node0 alone runs an epoch
# in 0.5 s idle, 0.7 s beside the layout matrix, and node1 healed 3.4 s after its start idle (epoch 15),
# 10.2 s under load (epoch 24 of 24: node0 ended as it healed, node1 finished alone, the weights parted).
# 32 leaves node1 about 17 s under load.
TORCHFT_EPOCHS = 32
TORCHFT_ACCOUNT_RE = [  # the account `make two-node-torchft` ends with, line by line
    r"the lighthouse's status page, http://localhost:(\d+)/status, showed node0 and node1 in quorum \d+",
    r"node0's world size by epoch: (?:.*, )?2 \((?:epochs )?(?:\d+-)?(\d+)\), "  # up to node1's kill
    rf"1 \((\d+)-(\d+)\), 2 \((\d+)-{TORCHFT_EPOCHS}\)",
    r"node0 logged epoch (\d+) ([\d.]+) s after node1's kill",
    r"node1 took node0's live state at step (\d+) \(epoch (\d+)\) ([\d.]+) s after its start",
    r"node1's first epoch after its start: (\d+) \(killed after (\d+)\)",
    rf"node0 and node1 ended at epochs {TORCHFT_EPOCHS} and {TORCHFT_EPOCHS} of {TORCHFT_EPOCHS}",
    r"their last snapshots: weights identical on 2 of 2 groups",
    r"exit codes: lighthouse 0, node0 0, node1 0",
]


def served(text, prefix):
    """The lines a service printed, from the output of `docker compose logs` (prefix: node0-1 and so on)."""
    return [line.split("| ", 1)[1] for line in text.splitlines() if re.match(rf"{prefix}\s+\| ", line)]


@SLOW
def test_make_two_node_torchft_heals_node1_from_node0_live(project, image):
    """`make two-node-torchft` (compose/torchft.yaml): a lighthouse, and replica groups 0 and 1 in node0 and
    node1. node1 is killed mid-run: node0 trains on alone, never restarts, resumes or goes back; node1 started
    again takes node0's live state and goes on from a later epoch than the one it was killed in; both end at
    the last epoch with identical weights, every container exits 0 (the lighthouse stops by itself), and the
    lighthouse's status page answers on the port published on the host while the groups train.

    Over a minute: a quorum every step, node1 killed and started again, 32 epochs (61 s idle)."""
    job, port = project(("compose/torchft.yaml",)), free_port()  # a name of this run, removed after
    make = ["make", "--no-print-directory", "-C", REPO, "two-node-torchft", f"IMAGE={image}"]
    options = f"--project {job.name} --port {port} --epochs {TORCHFT_EPOCHS}"
    make += [f"BASE_IMAGE={BASE_IMAGE}", f"TORCHFT_ARGS={options}"]
    pages, done = [], threading.Event()

    def watch():  # the status page, as a user's browser on this host asks for it
        while not done.wait(1):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as page:
                    pages.append(page.read().decode())
            except OSError:
                pass

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    start = time.monotonic()
    try:
        proc = run(make, timeout=1500, check=False)
    finally:
        done.set()
        watcher.join(timeout=10)
    print(f"make two-node-torchft: {time.monotonic() - start:.0f} s")
    print(proc.stdout.split("in short:\n")[-1])  # the account: the epochs and seconds node1 took to heal
    out = proc.stdout
    assert proc.returncode == 0, out[-5000:]
    assert any("Manager: http://node0:" in page and "Manager: http://node1:" in page for page in pages), pages
    logs, account = out.split("two-node torchft, in short:\n", 1)
    lines = account.splitlines()
    assert len(lines) == len(TORCHFT_ACCOUNT_RE), account  # no NOT: line naming a failed check
    found = [
        re.fullmatch(r"\s+" + pattern, line) for pattern, line in zip(TORCHFT_ACCOUNT_RE, lines, strict=True)
    ]
    assert all(found), account
    assert int(found[0][1]) == port
    with_both, alone_from, alone_to, again = map(int, found[1].groups())
    assert alone_from == with_both + 1 and again == alone_to + 1 and alone_to >= alone_from, account
    first, killed = map(int, found[4].groups())
    assert first > killed + 1, account  # healed: past the epoch it died in (its snapshot: killed + 1)
    # The lines the nodes printed (followed while they ran), apart from the account
    node0, node1 = served(logs, "node0-1"), served(logs, "node1-1")
    # node0 may have joined late and healed from node1 at the start (a quorum needs one group): from there
    epochs0 = [(int(m[1]), int(m[4])) for line in node0 if (m := EPOCH_RE.match(line))]
    assert [epoch for epoch, _ in epochs0] == list(range(epochs0[0][0], TORCHFT_EPOCHS + 1)), epochs0
    since = [(epoch, size) for epoch, size in epochs0 if epoch >= killed]
    sizes = [size for i, (_, size) in enumerate(since) if i == 0 or since[i - 1][1] != size]
    assert sizes == [2, 1, 2], epochs0  # with node1 up to its kill, alone, with node1 again
    assert sum(line.startswith("[group 0/2]") for line in node0) == 1, node0[:5]  # never restarted
    assert not any("resuming from" in line for line in node0)
    starts = [i for i, line in enumerate(node1) if line.startswith("[group 1/2]")]
    assert len(starts) == 2, node1[:5]
    before = [int(m[1]) for line in node1[: starts[1]] if (m := EPOCH_RE.match(line))]
    after = [int(m[1]) for line in node1[starts[1] :] if (m := EPOCH_RE.match(line))]
    assert before[-1] == killed and after[0] == first and after[-1] == TORCHFT_EPOCHS, (before, after)
    left = run(
        ["docker", "ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={job.name}"], timeout=60
    )
    assert not left.stdout.strip(), left.stdout
