"""The two-node Compose job without Docker: two network namespaces joined by a bridge (harness/netns.sh) play
node0 and node1, each running the command that compose/compose.yaml gives that node: two local torchrun
"nodes", uneven (2 processes and 1). Needs root. Budget: about 30 s."""

import os
import re
import shutil
import subprocess
import time

import pytest
import torch
import yaml
from helpers import (
    PYTHON,
    REPO,
    RUN_ID,
    TrainLog,
    assert_world,
    free_port,
    free_subnet,
    kill_group,
    need,
    popen,
    run,
    run_together,
)

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


def doctors(port, timeout):
    """tools/doctor.py --nodes 2 in both namespaces at once, node0's address the endpoint: (exit status,
    output) of each, and the seconds the slower took."""
    argv = [
        PYTHON,
        "tools/doctor.py",
        "--endpoint",
        f"node0:{port}",
        "--nodes",
        "2",
        "--timeout",
        str(timeout),
    ]
    start = time.monotonic()
    ended = run_together([in_host(host, argv) for host in HOSTS], timeout=timeout * 6, cwd=REPO)
    return dict(zip(HOSTS, ended, strict=True)), time.monotonic() - start


def test_the_doctor_on_both_nodes_meets_and_all_reduces_across_them(hosts):
    """`make doctor ENDPOINT=node0:PORT NODES=2` on each node: the nodes meet there (torch's c10d
    rendezvous), then a gloo all-reduce across them passes and gives its bandwidth. Mutation: the
    all-reduce's expected sum off by one: both nodes FAIL."""
    results, _ = doctors(free_port(), timeout=60)
    for host, (code, out) in results.items():
        assert code == 0, f"{host}:\n{out[-3000:]}"
        assert "PASS  nodes        2 nodes met at node0:" in out, out
        assert re.search(r"PASS  nodes        gloo all-reduce of 64 MB across 2 nodes: \d+ ms, busbw", out), (
            out
        )
    numbers = {re.search(r"this is node (\d)", out)[1] for _, out in results.values()}
    assert numbers == {"0", "1"}


def test_the_doctor_names_the_firewall_when_all_reduce_fails(hosts):
    """The doctor names the firewall when the nodes meet but cannot all reduce.

    A firewall on both nodes that lets in only the endpoint's port (and what answers connections made
    from inside): the nodes meet there, but gloo's own connections between them are dropped. Both end
    within the bound with a FAIL that says the nodes met and names the firewall and the interface
    variables. gloo's connections retry for about 100 s whatever timeout torch is given: the doctor waits
    for them at most its --timeout (20 s here) and says so. Mutation: the thread joined without a bound:
    the FAIL quotes gloo's connect timeout after about 100 s instead, and the test fails."""
    port = free_port()
    rules = [
        ["-i", "lo", "-j", "ACCEPT"],
        ["-p", "tcp", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
        ["-p", "tcp", "--dport", str(port), "-j", "ACCEPT"],
        ["-p", "tcp", "-j", "DROP"],
    ]
    for host in HOSTS:
        for rule in rules:
            run(["ip", "netns", "exec", f"{NAME}-{host}", "iptables", "-A", "INPUT", *rule], timeout=30)
    results, seconds = doctors(port, timeout=20)
    for host, (code, out) in results.items():
        assert code == 1, f"{host}:\n{out[-3000:]}"
        assert "PASS  nodes        2 nodes met at node0:" in out, out
        failed = re.search(r"FAIL  nodes        the nodes met at node0:\d+, but the all-reduce .*", out)
        assert failed and "did not finish within 20 s" in failed[0], out  # the doctor's bound, not gloo's
        assert "firewall" in failed[0] and "GLOO_SOCKET_IFNAME" in failed[0], out
    print(f"both doctors ended in {seconds:.0f} s")
