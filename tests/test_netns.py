"""The two-node Compose job without Docker: two network namespaces joined by a bridge (harness/netns.sh) play
node0 and node1, each running the command that compose/compose.yaml gives that node: two local torchrun
"nodes", uneven (2 processes and 1). Needs root. Budget: about 30 s."""

import os
import re
import shutil
import subprocess

import pytest
import torch
import yaml
from conftest import PYTHON, REPO, RUN_ID, TrainLog, assert_world, free_subnet, kill_group, need, popen, run

NETNS = REPO / "harness" / "netns.sh"
# unique per run of the suite (RUN_ID), so that two runs on one machine do not meet
NAME, HOSTS = f"n{RUN_ID}", ("node0", "node1")
NPROC = {"node0": 2, "node1": 1}
VARIABLES = {"EPOCHS": "4", "SAVE_EVERY": "2", "JOIN_TIMEOUT": "60", "NODE0_NPROC": "2", "NODE1_NPROC": "1"}
VARIABLE_RE = re.compile(r"\$\{(\w+)(?::-([^${}]*))?\}")  # an innermost one: its default has none inside


def interpolate(value, variables):
    """Compose's ${NAME} and ${NAME:-default}, defaults nested or not, taking values from variables."""
    value, previous = str(value), None
    while value != previous:
        previous, value = value, VARIABLE_RE.sub(lambda m: variables.get(m[1], m[2] or ""), value)
    return value


def node_job(service, snapshots):
    """argv and environment of one compose service, for this machine: this Python, the shared snapshot
    volume replaced by a local folder. Host names (node0) resolve through netns.sh."""
    argv = [interpolate(arg, VARIABLES) for arg in [*service["entrypoint"], *service["command"]]]
    assert argv[:2] == ["python", "tools/launch.py"], argv
    mount = next(v.split(":")[1] for v in service["volumes"] if v.startswith("snapshots:"))
    argv = [arg.replace(mount, str(snapshots)) for arg in [PYTHON, *argv[1:]]]
    env = {k: interpolate(v, VARIABLES) for k, v in service["environment"].items()}
    return argv, env


def in_host(host, argv):
    """Run argv in namespace NAME-host with its own host name, as a container would be."""
    set_name = 'echo "$0" >/proc/sys/kernel/hostname && exec "$@"'
    return ["ip", "netns", "exec", f"{NAME}-{host}", "unshare", "--uts", "sh", "-c", set_name, host, *argv]


@pytest.fixture
def hosts():
    need(
        os.geteuid() == 0 and shutil.which("ip") and shutil.which("unshare"),
        "network namespaces need root, ip and unshare",
        "REQUIRE_NETNS",
    )
    run([NETNS, "up", NAME, free_subnet(), *HOSTS], timeout=60)
    yield
    run([NETNS, "down", NAME, *HOSTS], timeout=60, check=False)


def test_compose_job_across_two_namespaces(hosts, tmp_path):
    services = yaml.safe_load((REPO / "compose" / "compose.yaml").read_text())["services"]
    jobs = {host: node_job(services[host], tmp_path) for host in HOSTS}
    node1_log = (tmp_path / "node1.log").open("w+")
    argv, env = jobs["node1"]
    # both nodes on the CPU (popen and run hide the GPUs alike), whatever this machine has
    node1 = popen(in_host("node1", argv), cwd=REPO, env=env, stdout=node1_log, stderr=subprocess.STDOUT)
    try:
        argv, env = jobs["node0"]
        node0 = run(in_host("node0", argv), cwd=REPO, env=env, timeout=300, check=False)
        node1_status = node1.wait(timeout=60)
    finally:
        kill_group(node1)
        node1.wait()
    node1_log.seek(0)
    node1_out = node1_log.read()
    both = f"--- node0\n{node0.stdout[-4000:]}\n--- node1\n{node1_out[-4000:]}"
    assert node0.returncode == 0 and node1_status == 0, both
    TrainLog(node0.stdout).assert_trained(world_size=sum(NPROC.values()))
    assert_world(node0.stdout + node1_out, NPROC)
    snapshot = next(tmp_path.glob("*.pt"))
    assert torch.load(snapshot, weights_only=True)["EPOCHS_RUN"] == int(VARIABLES["EPOCHS"])
