"""`make doctor` reports each check and fails when one fails."""

import socket
from datetime import timedelta

from helpers import REPO, VENV, doc_block, run
from torch.distributed import TCPStore


def doctor(endpoint, env=None):
    cmd = ["make", "-C", REPO, "doctor", f"VENV={VENV}", f"ENDPOINT={endpoint}"]
    return run(cmd, timeout=300, check=False, env=env)


def test_doctor_passes_with_a_reachable_endpoint():
    # what node 0's torchrun opens: a TCPStore
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    proc = doctor(f"127.0.0.1:{store.port}")
    assert proc.returncode == 0, proc.stdout
    lines = ["PASS  backends", "PASS  endpoint", "INFO  versions", "INFO  interfaces"]
    lines += ["INFO  route        to 127.0.0.1 (127.0.0.1) through interface lo: GLOO_SOCKET_IFNAME=lo"]
    lines += ["PASS  all-reduce   2 local processes agree on the sum (gloo on the CPU)"]
    for line in [*lines, "python 3.", "torch 2.13.0", "CUDA ", "NCCL "]:
        assert line in proc.stdout, line
    assert "doctor: all" in proc.stdout and "checks pass" in proc.stdout


def test_the_doctor_block_of_troubleshooting_md_passes_as_written():
    """docs/troubleshooting.md's first command, verbatim, from the repository root: every check passes.
    Mutation: the block given an interface that is not there (GLOO_SOCKET_IFNAME=eth9): exit 1."""
    marker = "<!-- tests/repo/test_doctor.py runs the next block as written -->"
    block = doc_block("docs/troubleshooting.md", marker)
    proc = run(["bash", "-c", "set -e\n" + block], timeout=300, cwd=REPO, check=False)
    assert proc.returncode == 0 and "checks pass" in proc.stdout, proc.stdout[-3000:]


def test_doctor_before_node_0_starts_checks_what_it_can_and_passes():
    """The pre-flight: node 0's job has not opened the port yet, so the host refuses it. The name, the route
    and the refusal (the host is reachable) are checked; no store answering is expected, not a failure."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound but not listening: connections are refused
        port = closed.getsockname()[1]
        proc = doctor(f"localhost:{port}")
    assert proc.returncode == 0, proc.stdout
    assert "PASS  endpoint     localhost resolves to 127.0.0.1" in proc.stdout, proc.stdout
    assert "INFO  route        to localhost (127.0.0.1) through interface lo" in proc.stdout, proc.stdout
    said = f"INFO  endpoint     127.0.0.1 refuses port {port}: it is reachable and nothing listens there yet"
    assert said in proc.stdout and "as expected until node 0's job starts" in proc.stdout, proc.stdout
    assert "doctor: all" in proc.stdout and "FAIL" not in proc.stdout


def test_doctor_fails_on_a_name_that_does_not_resolve():
    proc = doctor("no-such-node.invalid:29500")
    assert proc.returncode != 0
    assert "FAIL  endpoint     no-such-node.invalid does not resolve" in proc.stdout, proc.stdout


def test_doctor_fails_on_a_port_held_by_another_program():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()  # accepts connections, never answers
        proc = doctor(f"127.0.0.1:{listener.getsockname()[1]}")
    assert proc.returncode != 0
    assert "FAIL  endpoint" in proc.stdout and "does not answer as a torch rendezvous store" in proc.stdout


def test_doctor_fails_on_an_interface_variable_naming_no_interface():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    proc = doctor(f"127.0.0.1:{store.port}", env={"GLOO_SOCKET_IFNAME": "eth9", "NCCL_SOCKET_IFNAME": "lo"})
    assert proc.returncode != 0
    assert "FAIL  interface    GLOO_SOCKET_IFNAME=eth9: no interface eth9 on this machine" in proc.stdout
    assert "PASS  interface    NCCL_SOCKET_IFNAME=lo names an interface" in proc.stdout, proc.stdout
