"""What each test costs, and the order in which the workers take the tests (a pytest plugin of conftest.py).

Each test's wall seconds (setup, call and teardown) and the CPU seconds of the processes it started and
waited for (its children: torchrun and its workers, make, Docker's client; not what runs inside a container)
reach the session that started the workers; `make test` ends with the 30 costliest tests and the total of
each file. Tests go to the workers in groups, a file each, but for the files in SPREAD, whose tests go one
by one so that both workers carry them; the costliest groups first, by tests/costs.json, the record of a
whole run's group totals. `RECORD_COSTS=1 make test` rewrites the record from the run."""

import json
import os
import resource
from pathlib import Path

import pytest

RECORD = Path(__file__).with_name("costs.json")
_costs = {}  # test id -> [wall seconds, children's CPU seconds]


def children_cpu():
    """The CPU seconds of the processes this one waited for, and of the runs that tests/gpt's fork server
    (tests/programs/forkserver.py) made for it (which reach this process's count only when the server ends,
    as this total leaves it)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        served = float(Path(os.environ["FORKSERVER"] + ".cpu").read_text())
    except (KeyError, OSError, ValueError):
        served = 0.0
    return usage.ru_utime + usage.ru_stime + served


# the files whose tests the workers take one by one: the costliest, whose tests share little or share it
# once_per_session (helpers.py), so that no worker is left with a whole one at the end
SPREAD = ("deploy/test_docker.py", "gpt/test_gpt_layouts.py", "lessons/test_examples.py")


def group(nodeid):
    """The unit of work a worker takes: the test's file (relative to tests/), or the test in SPREAD."""
    test = nodeid.removeprefix("tests/")
    file = test.split("::")[0]
    return test if file in SPREAD else file


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scheduling by scope, each scope a group() (its loadgroup marks no longer reach its
    scheduler under pytest 9.2, which keeps a test's id where pytest-xdist cannot amend it)."""
    from xdist.scheduler import LoadScopeScheduling

    class Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return group(nodeid)

    return Groups(config, log)


# a test whose recorded wall time reached this in a whole run is marked slow (make test-fast leaves it out)
SLOW_SECONDS = 30


def recorded():
    """The record of a whole run: {"groups": {group: wall seconds}, "tests": {test: wall seconds},
    "cpu": {test: its children's CPU seconds}}."""
    return json.loads(RECORD.read_text()) if RECORD.exists() else {"groups": {}, "tests": {}}


def pytest_collection_modifyitems(items):
    """Costliest group first (a group the record lacks comes last), each file in its own order; a test the
    record gives SLOW_SECONDS or more is marked slow."""
    record = recorded()
    for item in items:
        if record["tests"].get(item.nodeid.removeprefix("tests/"), 0) >= SLOW_SECONDS:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: -record["groups"].get(group(item.nodeid), 0))


_start_key = pytest.StashKey[float]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_start_key] = children_cpu()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "teardown" and _start_key in item.stash:
        cpu = children_cpu() - item.stash[_start_key]
        outcome.get_result().user_properties += [("children_cpu", cpu), ("group", group(item.nodeid))]


def pytest_runtest_logreport(report):
    """In the session that started the workers (or the only one): every phase's report of every test."""
    cost = _costs.setdefault(report.nodeid, [0.0, 0.0, None])
    properties = dict(report.user_properties)
    cost[0] += report.duration
    cost[1] += properties.get("children_cpu", 0.0)
    cost[2] = properties.get("group", cost[2])


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workerinput") or not _costs:
        return
    write = terminalreporter.write_line
    write("")
    write("the 30 costliest tests: wall seconds, then the CPU seconds of the processes each started")
    for test, (wall, cpu, _) in sorted(_costs.items(), key=lambda c: -c[1][0])[:30]:
        write(f"{wall:8.1f} {cpu:8.1f}  {test}")
    files = {}
    for test, (wall, cpu, _) in _costs.items():
        total = files.setdefault(test.split("::")[0], [0.0, 0.0, 0])
        total[0] += wall
        total[1] += cpu
        total[2] += 1
    write("each file: wall seconds, CPU seconds of its processes, tests")
    for file, (wall, cpu, count) in sorted(files.items(), key=lambda f: -f[1][0]):
        write(f"{wall:8.1f} {cpu:8.1f} {count:4d}  {file}")
    write(f"{sum(f[0] for f in files.values()):8.1f} {sum(f[1] for f in files.values()):8.1f}  in all")
    if os.environ.get("RECORD_COSTS") == "1":
        record()


def record():
    """tests/costs.json from this run: each group's and each test's wall seconds, and each test's children's
    CPU seconds ("cpu"); those that did not run keep theirs."""
    kept = {"cpu": {}, **recorded()}
    groups, tests, cpu = {}, {}, {}
    for test, (wall, children, name) in _costs.items():
        tests[test.removeprefix("tests/")] = round(wall, 1)
        cpu[test.removeprefix("tests/")] = round(children, 1)
        if name is not None:
            groups[name] = groups.get(name, 0.0) + wall
    kept["groups"].update({name: round(wall, 1) for name, wall in groups.items()})
    kept["tests"].update(tests)
    kept["cpu"].update(cpu)
    parts = ("groups", "tests", "cpu")
    by_cost = {part: dict(sorted(kept[part].items(), key=lambda g: -g[1])) for part in parts}
    RECORD.write_text(json.dumps(by_cost, indent=1) + "\n")
