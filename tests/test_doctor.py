"""`make doctor` reports each check and fails when one fails."""

import socket

from conftest import REPO, VENV, run


def doctor(endpoint):
    cmd = ["make", "-C", REPO, "doctor", f"VENV={VENV}", f"ENDPOINT={endpoint}"]
    return run(cmd, timeout=300, check=False)


def test_doctor_passes_with_a_reachable_endpoint():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        proc = doctor(f"127.0.0.1:{listener.getsockname()[1]}")
    assert proc.returncode == 0, proc.stdout
    for line in ["PASS  backends", "PASS  endpoint", "PASS  all-reduce", "INFO  versions", "torch 2.13.0"]:
        assert line in proc.stdout
    assert "doctor: all" in proc.stdout and "checks pass" in proc.stdout


def test_doctor_fails_and_explains_an_unreachable_endpoint():
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound but not listening: connections are refused
        proc = doctor(f"127.0.0.1:{closed.getsockname()[1]}")
    assert proc.returncode != 0
    assert "FAIL  endpoint" in proc.stdout and "Usual causes" in proc.stdout
    assert "doctor: 1 of" in proc.stdout and "checks FAILED" in proc.stdout
