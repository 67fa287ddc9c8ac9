"""The two-node Compose files (compose.yaml at the root, compose/) and the image's inputs, read without a
Docker daemon: each variant parses and runs the job it names, the GPU files differ from the CPU ones only in
devices, the build context is an allowlist whose every file marks the image out of date, and the demos'
output filter. The Compose checks need only the client, `docker compose` v2.20 or later
(docker/install-compose.sh installs the pinned one), and skip without it unless REQUIRE_DOCKER=1; the
image, the containers and the real runs are test_docker.py's. Budget: under 10 s.
"""

import json
import os
import re
import shutil
import subprocess

import pytest
import yaml
from helpers import PYTHON, REPO, need, run

COMPOSE_DIR = REPO / "compose"


CPU = ("compose.yaml",)  # what plain `docker compose up` at the root runs


GPU = ("compose.yaml", "compose/gpu.yaml")


VARIANTS = {
    "cpu": CPU,
    "gpu": GPU,
    "accelerate-cpu": (*CPU, "compose/accelerate.yaml"),
    "accelerate-gpu": (*GPU, "compose/accelerate.yaml"),
    "gpt-cpu": (*CPU, "compose/gpt.yaml"),
    "gpt-gpu": (*GPU, "compose/gpt.yaml"),
    "elastic-cpu": (*CPU, "compose/elastic.yaml"),
    "elastic-gpu": (*GPU, "compose/elastic.yaml"),
    "ray-cpu": (*CPU, "compose/ray.yaml"),
    "ray-gpu": (*GPU, "compose/ray.yaml"),
}


PROJECT = "ddp"  # the project name in the files, shared by `make two-node*` and plain `docker compose`


def compose_version():
    """`docker compose version --short` as a tuple of ints, or None without the plugin."""
    if not shutil.which("docker"):
        return None
    try:
        out = subprocess.run(
            ["docker", "compose", "version", "--short"], capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        return None
    numbers = re.match(r"v?(\d+)\.(\d+)", out.stdout.strip()) if out.returncode == 0 else None
    return tuple(map(int, numbers.groups())) if numbers else None


def compose_args(files):
    return [arg for name in files for arg in ("-f", REPO / name)]


@pytest.fixture(scope="session")
def compose():
    version = compose_version()
    need(version, "no Compose client (docker compose)", "REQUIRE_DOCKER")
    # compose.yaml's include: and the files' top-level name: need Compose 2.20 or later
    assert version >= (2, 20), f"docker compose {version} is too old: docker/install-compose.sh"
    return ["docker", "compose"]


def resolved(compose, files=None, cwd=REPO, env=None, profiles=()):
    """The configuration Compose would run: files merged, anchors and ${VARIABLES} resolved."""
    args = compose_args(files) if files else []
    args += [arg for profile in profiles for arg in ("--profile", profile)]
    return yaml.safe_load(run([*compose, *args, "config"], timeout=60, cwd=cwd, env=env).stdout)


@pytest.mark.parametrize("variant", VARIANTS)
def test_compose_files_parse(compose, variant):
    config = resolved(compose, VARIANTS[variant])
    assert config["name"] == PROJECT
    assert set(config["services"]) == {"node0", "node1"}
    for name, service in config["services"].items():
        assert service["hostname"] == name
        assert "ports" not in service, "the rendezvous port must stay on the project network"
        assert "network_mode" not in service, "the host's network would expose every port"
        assert "cap_add" not in service and "user" not in service, "training runs as the image's user"
        assert {"type": "volume", "source": "snapshots", "target": "/snapshots"}.items() <= service[
            "volumes"
        ][0].items()


def test_only_the_shaping_helpers_share_a_nodes_network(compose):
    """Profile shaped adds one helper per node, in that node's network namespace (never the host's), with
    NET_ADMIN; the training services stay as they are."""
    services = resolved(compose, CPU, profiles=["shaped"])["services"]
    assert set(services) == {"node0", "node1", "shape0", "shape1"}
    for node in ("node0", "node1"):
        helper = services[node.replace("node", "shape")]
        assert helper["network_mode"] == f"service:{node}"
        assert helper["cap_add"] == ["NET_ADMIN"]
        assert helper["entrypoint"][:2] == ["shape-link", "1gbit"]
        assert normalized(services[node]) == normalized(resolved(compose, CPU)["services"][node])
    env = {"LINK_RATE": "100mbit", "LINK_DELAY": "5ms"}
    helper = resolved(compose, CPU, env=env, profiles=["shaped"])["services"]["shape1"]
    assert helper["entrypoint"] == ["shape-link", "100mbit", "5ms"]


@pytest.mark.parametrize(
    ("args", "message"), [(["100mb"], "RATE must be"), (["1gbit", "5"], "DELAY must be")]
)
def test_a_mistyped_link_setting_is_refused_before_tc_runs(args, message):
    """Rates in bits only (tc's own mbps means megabytes), delays with a unit: anything else stops the helper
    with its usage and status 2 before tc runs."""
    proc = run([REPO / "docker" / "shaper" / "shape-link.sh", *args], timeout=30, check=False)
    assert proc.returncode == 2 and message in proc.stdout and "usage:" in proc.stdout, proc.stdout


def test_plain_up_is_the_cpu_job_at_the_root_and_in_compose_dir(compose):
    """`docker compose up` without -f: at the root and in compose/, the same CPU job in the same project."""
    root = resolved(compose, cwd=REPO)
    inside = resolved(compose, cwd=COMPOSE_DIR)
    assert root["name"] == inside["name"] == PROJECT
    assert root["services"] == inside["services"] == resolved(compose, CPU)["services"]
    for service in root["services"].values():
        assert "deploy" not in service
        assert "CUDA_VISIBLE_DEVICES" not in service["environment"]


def test_node0_builds_a_missing_image_from_the_repository(compose):
    """No registry holds the image: node0 builds it (once, for both nodes) from the Dockerfile, on the base
    image named by BASE_IMAGE when that is set, else on the Dockerfile's default."""
    services = resolved(compose)["services"]
    assert services["node0"]["build"]["context"] == str(REPO)
    assert "args" not in services["node0"]["build"], "unset BASE_IMAGE must leave the Dockerfile's default"
    assert "build" not in services["node1"]
    assert {s["pull_policy"] for s in services.values()} == {"never"}
    assert services["node0"]["image"] == services["node1"]["image"]
    build = resolved(compose, env={"BASE_IMAGE": BASE_IMAGE})["services"]["node0"]["build"]
    assert build["args"] == {"BASE_IMAGE": BASE_IMAGE}


def test_each_node_takes_its_own_process_count(compose):
    def counts(**env):
        services = resolved(compose, env=env)["services"]
        return [services[n]["environment"]["PET_NPROC_PER_NODE"] for n in ("node0", "node1")]

    assert counts() == ["2", "2"]
    assert counts(NPROC_PER_NODE="1") == ["1", "1"]
    assert counts(NODE0_NPROC="2", NODE1_NPROC="1") == ["2", "1"]
    assert counts(NPROC_PER_NODE="3", NODE1_NPROC="1") == ["3", "1"]


def test_make_runs_the_project_of_plain_compose():
    """make's two-node targets and two-node-down address the files' project (no -p of their own), so
    `docker compose down --volumes` and `make two-node-down` clean up the same thing."""
    out = run(["make", "-n", "two-node-cpu", "two-node", "two-node-down"], timeout=30, cwd=REPO).stdout
    commands = [line for line in out.splitlines() if "docker compose" in line]
    assert len(commands) == 3, out
    for line in commands:
        assert not re.search(r"\s(-p|--project-name)\b", line), line
        assert "-f compose.yaml" in line, line


def test_gpu_variant_reserves_gpus(compose):
    for service in resolved(compose, GPU)["services"].values():
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert any("gpu" in d["capabilities"] for d in devices)
        assert service["shm_size"]
        assert service["environment"]["NCCL_SOCKET_IFNAME"] == service["environment"]["GLOO_SOCKET_IFNAME"]
    in_dir = run([*compose, "-f", "compose.yaml", "-f", "gpu.yaml", "config"], timeout=60, cwd=COMPOSE_DIR)
    assert yaml.safe_load(in_dir.stdout)["services"] == resolved(compose, GPU)["services"]
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


@pytest.mark.parametrize("example", ["", "accelerate-", "elastic-", "gpt-", "ray-"])
def test_gpu_and_cpu_variants_run_the_same_job(compose, example):
    """The GPU files differ from the CPU ones by device settings only, so the variants cannot drift."""
    cpu = resolved(compose, VARIANTS[example + "cpu"])["services"]
    gpu = resolved(compose, VARIANTS[example + "gpu"])["services"]
    without_devices = {name: normalized(service, devices=False) for name, service in gpu.items()}
    assert without_devices == {name: normalized(service) for name, service in cpu.items()}
    if example != "ray-":  # the same launcher on both nodes; Ray has a head and a worker node
        # accelerate launch numbers its machine: the one difference allowed
        same = [
            [a for a in cpu[n]["entrypoint"] if not a.startswith("--machine_rank=")]
            for n in ("node0", "node1")
        ]
        assert same[0] == same[1]
        assert ("--machine_rank=1" in cpu["node1"]["entrypoint"]) == (example == "accelerate-")
        assert cpu["node0"]["command"] == cpu["node1"]["command"]


def test_accelerate_variant_runs_the_accelerate_example(compose):
    for service in resolved(compose, VARIANTS["accelerate-cpu"])["services"].values():
        assert service["command"][0] == "examples/multigpu_accelerate.py"
        assert f"--snapshot_path={SNAPSHOTS['accelerate']}" in service["command"]


def test_build_context_is_an_allowlist():
    """Nothing from the working tree (keys, .env files, snapshots) reaches the image unless named."""
    lines = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()]
    rules = [line for line in lines if line and not line.startswith("#")]
    assert rules[0] == "*", rules
    assert all(rule.startswith("!") or rule.startswith("**/") for rule in rules[1:]), rules


def test_every_file_the_image_copies_marks_it_out_of_date(tmp_path):
    """The Dockerfile copies only from .dockerignore's list, and docker/image-inputs.sh, whose checksum the
    image carries and make's IMAGE_SUM is, hashes every file of that list: a file the image carries cannot
    change without the image being out of date. Checked on a copy: every tracked file under a COPY source is
    hashed, make's sum is the script's, and editing a file changes it (`COPY .` is the checksum's stage)."""
    copies = re.findall(r"^COPY (?!--from)(.+)$", (REPO / "Dockerfile").read_text(), re.M)
    sources = sorted({source.rstrip("/") for line in copies for source in line.split()[:-1]} - {"."})
    assert {"examples", "tools"} <= set(sources), sources
    carried = run(["git", "ls-files", *sources], timeout=60, cwd=REPO).stdout.split()
    assert len(carried) > len(sources), carried
    shutil.copytree(REPO, tmp_path / "repo", ignore=shutil.ignore_patterns(".git", ".venv", "runs", "*.pt"))
    script = tmp_path / "repo" / "docker" / "image-inputs.sh"
    hashed = run([script, "--files", tmp_path / "repo"], timeout=60).stdout.split()
    assert sorted(set(carried) - set(hashed)) == [] and {"Dockerfile", ".dockerignore"} <= set(hashed)
    show = ["make", "-s", "-C", tmp_path / "repo", "--eval", "show: ; @echo $(IMAGE_SUM)", "show"]
    total = run(show, timeout=60).stdout.strip()
    assert total == run([script, tmp_path / "repo"], timeout=60).stdout.strip()
    with open(tmp_path / "repo" / carried[-1], "a") as edited:
        edited.write("\n")
    assert run(show, timeout=60).stdout.strip() != total


def test_the_two_node_targets_and_in_docker_steps_build_only_when_needed():
    prerequisites = run(["make", "-p", "-n", "-C", REPO, "help"], timeout=30).stdout
    for target in ("two-node", "two-node-cpu", "two-node-accelerate", "two-node-failover"):
        assert re.search(rf"^{target}: image-current$", prerequisites, re.M), target
    docker_steps = run(["make", "-p", "-n", "-C", REPO, "help", "IN_DOCKER=1"], timeout=30).stdout
    assert re.search(r"^multigpu: image-current$", docker_steps, re.M)


def test_the_demos_show_container_output_without_cpp_frames():
    """The demos show the containers' output without C++ frames or terminal codes.

    What the two-node demos echo of `docker compose logs --follow`: a c10 error's C++ frames (real ones,
    from TORCH_SHOW_CPP_STACKTRACES=1) and Compose's line erase left out, the error itself kept.
    Mutation: shown() returning the line as it is: frames are shown, and the test fails."""
    code = "import torch; torch.ones(2).view(3)"
    lines = ["node1-1  | frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x98\n"]
    for symbolize in ("1", "0"):  # both forms of the stack: addr2line's names, and addresses
        env = {**os.environ, "TORCH_SHOW_CPP_STACKTRACES": "1", "TORCH_DISABLE_ADDR2LINE": symbolize}
        error = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, env=env).stderr
        assert "c10::Error::Error" in error, error  # a real c10 error with its C++ stack
        lines += [f"node0-1  | {line}\n" for line in error.splitlines()]
    lines.append("\r\x1b[Knode0-1 exited with code 0\n")
    from compose_project import shown  # demos/, on the path conftest gives

    out = "".join(map(shown, lines))
    assert "frame #" not in out and "c10::" not in out and "raised from" not in out and "\x1b" not in out, out
    assert out.count("RuntimeError: shape '[3]' is invalid for input of size 2") == 2
    assert out.endswith("node0-1 exited with code 0\n")


BASE_IMAGE = "local/ddp-base:bookworm"


# Each variant writes its snapshot here on the shared volume (see the compose files).
SNAPSHOTS = {
    "multinode": "/snapshots/multinode.pt",
    "accelerate": "/snapshots/accelerate.pt",
    "gpt": "/snapshots/gpt",
    "ray": "/snapshots/ray.pt",
}
