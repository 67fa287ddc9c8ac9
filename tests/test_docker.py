"""The Docker image and the two-node Compose files (compose/).

Real runs (image build, CPU and accelerate variants across two containers) need a Docker daemon; the
configuration checks need only a Compose client. Both skip when missing, unless REQUIRE_DOCKER=1.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest
import yaml
from conftest import REPO, TrainLog, need, run

COMPOSE_DIR = REPO / "compose"
CPU = ("compose.yaml",)
GPU = ("compose.yaml", "compose.override.yaml")
VARIANTS = {
    "cpu": CPU,
    "gpu": GPU,
    "accelerate-cpu": (*CPU, "accelerate.yaml"),
    "accelerate-gpu": (*GPU, "accelerate.yaml"),
    "elastic-cpu": (*CPU, "elastic.yaml"),
    "elastic-gpu": (*GPU, "elastic.yaml"),
}
BASE_IMAGE = "local/ddp-base:bookworm"
IMAGE = "ddp-examples:test"
EPOCHS, SAVE_EVERY = 4, 2
# Each variant writes its snapshot here on the shared volume (see the compose files).
SNAPSHOTS = {"multinode": "/snapshots/multinode.pt", "accelerate": "/snapshots/accelerate.pt"}


def succeeds(cmd, timeout=30):
    try:
        return subprocess.run(cmd, capture_output=True, timeout=timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def compose_client():
    """`docker compose` (v2) if installed, else `docker-compose` (v1), else None: as the Makefile picks."""
    if shutil.which("docker") and succeeds(["docker", "compose", "version"]):
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def compose_args(files):
    return [arg for name in files for arg in ("-f", COMPOSE_DIR / name)]


@pytest.fixture(scope="session")
def compose():
    client = compose_client()
    need(client, "no Compose client (docker compose or docker-compose)", "REQUIRE_DOCKER")
    return client


def resolved(compose, files=None, cwd=REPO, env=None):
    """The configuration Compose would run: files merged, anchors and ${VARIABLES} resolved."""
    args = compose_args(files) if files else []
    return yaml.safe_load(run([*compose, *args, "config"], timeout=60, cwd=cwd, env=env).stdout)


# ---- configuration (no daemon needed) ----


@pytest.mark.parametrize("variant", VARIANTS)
def test_compose_files_parse(compose, variant):
    services = resolved(compose, VARIANTS[variant])["services"]
    assert set(services) == {"node0", "node1"}
    for name, service in services.items():
        assert service["hostname"] == name
        assert "ports" not in service, "the rendezvous port must stay on the project network"
        assert "network_mode" not in service, "the host's network would expose every port"
        assert any(v.endswith(":/snapshots") or ":/snapshots:" in v for v in map(str, service["volumes"]))


def test_plain_up_in_compose_dir_is_the_gpu_variant(compose):
    assert resolved(compose, cwd=COMPOSE_DIR)["services"] == resolved(compose, GPU)["services"]


def test_gpu_variant_reserves_gpus(compose):
    for service in resolved(compose, GPU)["services"].values():
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert any("gpu" in d["capabilities"] for d in devices)
        assert service["shm_size"]
        assert service["environment"]["NCCL_SOCKET_IFNAME"] == service["environment"]["GLOO_SOCKET_IFNAME"]
    for service in resolved(compose, CPU)["services"].values():
        assert "deploy" not in service


def normalized(service, devices=True):
    """A copy of a resolved service, empty network settings written one way, GPU settings optional."""
    service = json.loads(json.dumps(service))
    service["networks"] = {name: value or {} for name, value in service["networks"].items()}
    if not devices:
        service.pop("deploy", None)
        service["environment"].pop("CUDA_VISIBLE_DEVICES", None)
    return service


@pytest.mark.parametrize("example", ["", "accelerate-", "elastic-"])
def test_gpu_and_cpu_variants_run_the_same_job(compose, example):
    """The GPU files differ from the CPU ones by device settings only, so the variants cannot drift."""
    cpu = resolved(compose, VARIANTS[example + "cpu"])["services"]
    gpu = resolved(compose, VARIANTS[example + "gpu"])["services"]
    without_devices = {name: normalized(service, devices=False) for name, service in gpu.items()}
    assert without_devices == {name: normalized(service) for name, service in cpu.items()}
    assert cpu["node0"]["entrypoint"] == cpu["node1"]["entrypoint"]
    assert cpu["node0"]["command"] == cpu["node1"]["command"]


def test_accelerate_variant_runs_the_accelerate_example(compose):
    for service in resolved(compose, VARIANTS["accelerate-cpu"])["services"].values():
        assert service["command"][0] == "examples/multigpu_accelerate.py"
        assert f"--snapshot_path={SNAPSHOTS['accelerate']}" in service["command"]


# ---- real containers ----


def docker_daemon():
    return bool(shutil.which("docker")) and succeeds(["docker", "info"])


@pytest.fixture(scope="session")
def image(compose):
    """The project image, built on a base made offline by docker/build-base.sh (no registry needed)."""
    need(docker_daemon(), "no reachable Docker daemon (docker/start-daemon.sh starts one)", "REQUIRE_DOCKER")
    start = time.monotonic()
    run([REPO / "docker" / "build-base.sh", BASE_IMAGE], timeout=900)
    based = time.monotonic()
    run(["docker", "build", "-q", "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", "-t", IMAGE, REPO], timeout=1800)
    size = run(["docker", "image", "inspect", "-f", "{{.Size}}", IMAGE], timeout=60).stdout.strip()
    print(
        f"base image {based - start:.0f} s, project image {time.monotonic() - based:.0f} s, "
        f"{int(size) / 1e9:.2f} GB"
    )
    return IMAGE


class ComposeProject:
    """One Compose project (containers, network, snapshot volume) with a unique name, removed at the end."""

    def __init__(self, compose, name, files, **variables):
        self.cmd = [*compose, "-p", name, *compose_args(files)]
        self.env = {k: str(v) for k, v in variables.items()}

    def __call__(self, *args, timeout=120, check=True):
        return run([*self.cmd, *args], timeout=timeout, check=check, env=self.env)

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
        ids = self("ps", "-q", service).stdout.split()
        assert ids, f"no container for {service}"
        return ids[0]

    def logs(self, service):
        """What the service printed, without Compose's prefixes."""
        return run(["docker", "logs", self.container(service)], timeout=60).stdout

    def snapshot_epochs(self, path, service="node1"):
        """EPOCHS_RUN of the snapshot at path, read through the given node's view of the shared volume."""
        code = f"import torch; print(torch.load({path!r}, weights_only=True)['EPOCHS_RUN'])"
        out = self("run", "--rm", "--no-deps", "--entrypoint", "python", service, "-c", code).stdout
        return int(out.split()[-1])

    def down(self):
        self("down", "--volumes", "--remove-orphans", "--timeout", "5", check=False)


@pytest.fixture
def project(compose, image, request):
    """Makes Compose projects for a test; every one is torn down afterwards, even on failure."""
    made = []

    def make(files, **variables):
        name = f"ddptest{os.getpid()}{len(made)}"
        variables = {"DDP_IMAGE": image, "EPOCHS": EPOCHS, "SAVE_EVERY": SAVE_EVERY, **variables}
        proj = ComposeProject(compose, name, files, **variables)
        made.append(proj)
        proj.down()
        return proj

    yield make
    for proj in made:
        proj.down()


def test_build_context_is_an_allowlist():
    """Nothing from the working tree (keys, .env files, snapshots) reaches the image unless named."""
    lines = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()]
    rules = [line for line in lines if line and not line.startswith("#")]
    assert rules[0] == "*", rules
    assert all(rule.startswith("!") or rule.startswith("**/") for rule in rules[1:]), rules


def test_image_runs_as_a_non_root_user_without_secrets(image):
    user = run(["docker", "image", "inspect", "-f", "{{.Config.User}}", image], timeout=60).stdout.strip()
    assert user not in ("", "root", "0"), user
    uid = run(["docker", "run", "--rm", "--entrypoint", "id", image, "-u"], timeout=120).stdout.split()[-1]
    assert uid != "0"
    env = run(["docker", "image", "inspect", "-f", "{{json .Config.Env}}", image], timeout=60).stdout
    names = [item.split("=", 1)[0] for item in json.loads(env)]
    assert not [n for n in names if re.search(r"TOKEN|SECRET|PASSWORD|API_KEY|CREDENTIAL", n)], names


# Real runs: the first one also waits for the image build (minutes on a cold machine).
SLOW = pytest.mark.timeout(1800)


@SLOW
@pytest.mark.parametrize(("variant", "snapshot"), [("cpu", "multinode"), ("accelerate-cpu", "accelerate")])
def test_two_containers_train_one_job(project, variant, snapshot):
    proj = project(VARIANTS[variant])
    proc, seconds = proj.up()
    print(f"{variant}: compose run {seconds:.0f} s")
    assert proc.returncode == 0, proc.stdout[-6000:]
    log = TrainLog(proj.logs("node0"))
    log.assert_trained(world_size=4)
    assert log.num_hosts == 2, log.text[-3000:]
    assert log.checksum
    assert proj.snapshot_epochs(SNAPSHOTS[snapshot]) == EPOCHS


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


@SLOW
def test_node1_crash_and_docker_kill_are_survived(project):
    """node1 fails twice mid-training. First its main process dies (a crash or the OOM killer): Docker
    restarts the container by itself (compose/elastic.yaml). Then `docker kill node1`, which Docker treats
    as a deliberate stop: `compose start node1` brings it back. Each time torchrun restarts node0's
    processes, both nodes meet again and resume from the snapshot; the job ends with the weights of an
    uninterrupted run."""
    need(os.geteuid() == 0, "killing a container's process from the host needs root", "REQUIRE_DOCKER")
    job = {"EPOCHS": 40, "SAVE_EVERY": 5}
    reference = project(CPU, **job)
    proc, _ = reference.up()
    assert proc.returncode == 0, proc.stdout[-3000:]
    expected = TrainLog(reference.logs("node0")).checksum
    assert expected

    proj = project((*CPU, "elastic.yaml"), **job)
    proj("up", "-d")
    node0, node1 = proj.container("node0"), proj.container("node1")

    def restarts():
        return int(run(["docker", "inspect", "-f", "{{.RestartCount}}", node1], timeout=30).stdout)

    def wait_for_epoch(epoch):
        deadline = time.monotonic() + 300
        while not re.search(rf"^epoch {epoch}/", proj.logs("node0"), re.M):
            assert time.monotonic() < deadline, f"training did not reach epoch {epoch} in time"
            time.sleep(0.5)

    wait_for_epoch(6)
    pid = run(["docker", "inspect", "-f", "{{.State.Pid}}", node1], timeout=30).stdout
    os.kill(int(pid), signal.SIGKILL)
    wait_for_epoch(16)  # after the resume from epoch 5, so node1 is back and training
    assert restarts() >= 1

    run(["docker", "kill", node1], timeout=60)
    run(["docker", "wait", node1], timeout=60)
    proj("start", "node1")  # Docker does not restart a killed container; an operator does

    status = run(["docker", "wait", node0], timeout=600).stdout.strip()
    log = TrainLog(proj.logs("node0"))
    assert status == "0", log.text[-4000:]
    assert log.text.count("resuming from /snapshots/multinode.pt") == 2, log.text[-4000:]
    log.assert_trained(world_size=4)
    assert log.epochs[-1] == 40
    assert log.checksum == expected
