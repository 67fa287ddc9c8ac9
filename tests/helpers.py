"""The suite's helpers, imported by the test files: paths, commands run with a bound and killed whole,
the examples' output read, ports and subnets of this run's own, the session's shared folder."""

import contextlib
import fcntl
import importlib.util
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# the one sys.path edit of the suite: the tests import steps, k8s_check, lessons (benchmarks/), why_hung,
# compose_project and fault (demos/: the retry after torch's error-file race), and tests/repo/test_gpu.py
# the GPT tests' helpers (tests/gpt/), also when it runs alone
sys.path[:0] = [str(REPO / folder) for folder in ("harness", "benchmarks", "tools", "demos", "tests/gpt")]
import steps  # noqa: E402  (harness/steps.py: how each step is started, shared with the Makefile and the bench)

EXAMPLES = REPO / "examples"
# The programs the tests start, as files: scripts, and folders holding a sitecustomize.py. Those that import
# the GPT package get it from PYTHONPATH, the one way they find it.
PROGRAMS = REPO / "tests" / "programs"
SITES = PROGRAMS / "sites"  # folders of a sitecustomize.py each, put on PYTHONPATH
GPT_ON_PATH = {"PYTHONPATH": str(EXAMPLES / "gpt")}
# the lessons torchrun starts with several processes, which say a refusal once, in its closing summary
TORCHRUN_LESSONS = ["multigpu_torchrun", "multinode", "multigpu_accelerate"]
PYTHON = sys.executable
TORCHRUN = [PYTHON, "-m", "torch.distributed.run"]
# N ranks forked from one process that imported torch once, in torchrun's environment (programs/forkrun.py):
# the GPT runs whose subject is not the launcher (restarts, signals, torchrun's summary and rendezvous are)
FORKRUN = [PYTHON, str(Path(__file__).parent / "programs" / "forkrun.py")]
VENV = Path(PYTHON).parent.parent  # the environment running the tests, handed to make as VENV

# The lessons' log lines; `make multinode` prefixes each node's output with "[nodeN] ". Rank 0, each epoch:
NODE = r"^(?:\[\w+\] )?"
EPOCH_RE = re.compile(NODE + r"epoch (\d+)/(\d+) \| loss ([0-9.eE+-]+) \| world_size (\d+)$", re.M)
# every DDP process at its start; multinode.py adds its place: local rank, node and host. Not anchored: two
# processes printing at once can put one's line break after the other's line.
RANK_RE = re.compile(
    r"\[rank (\d+)/(\d+)\] ([^,\s]+), ([a-z]+)(?:, local rank (\d+)/(\d+) on node (\d+) \(([^)\s]+)\))?"
)

# Ray prints `(RayTrainWorker pid=123) ` (`, ip=...` when from another node; no colour into a pipe) before
# an actor's lines
RAY_PREFIX_RE = re.compile(r"^\(\w+ pid=(\d+)(?:, ip=[\d.]+)?\) ", re.M)


def without_ray_prefixes(text):
    """The lines of Ray's actors (examples/multigpu_ray.py) as the lessons print them."""
    return RAY_PREFIX_RE.sub("", text)


def assert_world(text, per_host):
    """The rank lines in text (the output of every node) describe one world of sum(per_host.values())
    processes, per_host[name] of them on the node whose host name is name: each global rank once, every
    node with local ranks 0..n-1 and the block of global ranks that follows the nodes of lower GROUP_RANK
    (whichever node that is: the rendezvous decides); and rank 0's last epoch line says the same world."""
    lines = [
        (int(r), int(w), int(lr), int(lw), int(g), host)
        for r, w, _, _, lr, lw, g, host in RANK_RE.findall(text)
    ]
    world = sum(per_host.values())
    assert sorted(line[0] for line in lines) == list(range(world)), f"rank lines:\n{text[-4000:]}"
    nodes = {}  # GROUP_RANK: (host, local world size)
    for _, size, _, local_size, node, host in lines:
        assert size == world, f"world size {size}, expected {world}"
        assert nodes.setdefault(node, (host, local_size)) == (host, local_size), f"node {node}: {lines}"
    assert sorted(nodes) == list(range(len(per_host))), f"group ranks {sorted(nodes)}"
    assert dict(nodes.values()) == per_host, f"processes per host {dict(nodes.values())}, expected {per_host}"
    for rank, _, local, local_size, node, _ in lines:
        first = sum(nodes[lower][1] for lower in range(node))
        assert local < local_size and rank == first + local, f"rank {rank}: local {local} on node {node}"
    last = EPOCH_RE.findall(text)[-1:]
    assert last and int(last[0][3]) == world, f"no last epoch of a world of {world}:\n{text[-3000:]}"


# The GPUs this test run may use. Commands run on the CPU unless a test passes env=GPU_ENV; the tests that
# do are marked gpu and skipped where torch sees no GPU, as in CI (tests/conftest.py).
GPUS = torch.cuda.device_count()
GPU_ENV = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(GPUS)))}
# The one way a CPU test hides the GPUs, whatever the machine has: torch, the lessons, harness/steps.py and
# the Makefile (its GPUS counts the devices CUDA_VISIBLE_DEVICES names when it is set) all honour it.
CPU_ENV = {"CUDA_VISIBLE_DEVICES": ""}

# This run of the suite, unique among runs on one machine: names of namespaces, images, Compose projects.
RUN_ID = secrets.token_hex(3)
# Every process the suite starts inherits this variable; at the end of the session none may be left alive.
SESSION_VAR = "DDP_TEST_SESSION"
# pytest-timeout's bound of the running test (its own bounds stay below it): a time.monotonic() deadline
deadline = [float("inf")]
PORT_LOCKS = Path(tempfile.gettempdir()) / "ddp-test-ports"
_held_ports = {}  # port -> the open lock file that holds it for this session


def free_port():
    """A TCP port that nothing listens on, reserved for this session until it ends: below the kernel's
    ephemeral range (so no outgoing connection is given it while the process that listens on it starts),
    never handed out twice in a session, and locked (flock on a file in PORT_LOCKS) against other runs of
    the suite on this machine."""
    PORT_LOCKS.mkdir(exist_ok=True)
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(20000, min(low, 32768)), 200):
        if port in _held_ports:
            continue
        lock = (PORT_LOCKS / f"{port}.lock").open("w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with socket.socket() as s:  # nothing (outside the suite) listens on it now
                s.bind(("", port))
        except OSError:
            lock.close()
            continue
        _held_ports[port] = lock
        return port
    raise RuntimeError("no free port below the ephemeral range after 200 tries")


def free_subnet():
    """The first three octets of a 10.x.y.0/24 that no interface of this machine uses: namespaces and
    bridges of one run do not meet another run's."""
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, timeout=10).stdout
    for _ in range(200):
        subnet = f"10.{random.randrange(100, 250)}.{random.randrange(1, 255)}"
        if f" {subnet}." not in used:
            return subnet
    raise RuntimeError("no free 10.x.y.0/24 subnet after 200 tries")


def kill_group(proc, stacks=False):
    """SIGKILL the process group that proc leads and every process below it, also those that lead sessions
    of their own (torchrun's workers): nothing a test started outlives it, to hold its pipe or the cores.
    stacks: first SIGABRT the Python processes among them, whose faulthandler (CRASH_ENV) then prints
    every thread's stack into the output the test shows, so that a hang says where it waited."""
    try:
        tree = [psutil.Process(proc.pid)]
        tree += tree[0].children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    if stacks:
        pythons = []
        for process in tree:
            with contextlib.suppress(psutil.Error):
                if process.name().startswith("python"):
                    process.send_signal(signal.SIGABRT)
                    pythons.append(process)
        psutil.wait_procs(pythons, timeout=5)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for process in tree:
        with contextlib.suppress(psutil.Error):
            process.kill()


# Every Python process the tests start writes its threads' stacks to stderr if it crashes (SIGSEGV,
# SIGABRT, ...): a crash seen once under load then says where it was.
CRASH_ENV = {"PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}


def popen(cmd, *, env=None, cpu=True, **kwargs):
    """Popen cmd in a process group of its own (killed as one by kill_group), on the CPU unless cpu=False,
    with env added to this process's environment."""
    full_env = {**os.environ, **CRASH_ENV, **(CPU_ENV if cpu else {}), **(env or {})}
    # a make the command runs is a user's top-level make, not a sub-make of `make test` ("make[1]: ...")
    full_env.pop("MAKELEVEL", None)
    return subprocess.Popen([str(c) for c in cmd], env=full_env, start_new_session=True, **kwargs)


def bound(timeout):
    """timeout, or less where pytest-timeout would stop the test first: a command's bound then fires 15 s
    before it, and kills the command's process group with the output shown."""
    return max(1.0, min(timeout, deadline[0] - time.monotonic() - 15))


def communicate_while_progressing(proc, quiet, limit):
    """proc's whole output (stdout, text, one pipe) once it ends. A hang is a process that prints nothing
    for `quiet` seconds: the test fails, saying so. One that keeps printing may take up to `limit` seconds
    (cut to end before pytest-timeout), so that a slow machine makes a slow test, not a red one; past it
    the test fails, saying it was still making progress."""
    lines, last = [], [time.monotonic()]

    def read():
        for line in proc.stdout:
            lines.append(line)
            last[0] = time.monotonic()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    start, limit = time.monotonic(), bound(limit)
    while proc.poll() is None:
        now = time.monotonic()
        silent = now - last[0] > quiet
        if silent or now - start > limit:
            kill_group(proc)
            proc.wait()
            reader.join(timeout=10)
            why = f"no output for {quiet}s" if silent else f"still printing after {limit:.0f}s"
            pytest.fail(f"hung: {why}\n{''.join(lines)[-3000:]}")
        time.sleep(0.2)  # polling the process: how often the bounds are checked
    reader.join(timeout=10)
    return "".join(lines)


def run(cmd, *, timeout, check=True, env=None, **kwargs):
    """Run cmd in its own process group, capture stdout+stderr as text, fail the test with the output on
    error or timeout; on timeout or failure the whole group (torchrun's workers, make's children) is killed.
    CPU only (CPU_ENV) unless env says otherwise, so that the same assertions hold on a machine with GPUs."""
    limit = bound(timeout)
    proc = popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        kill_group(proc, stacks=True)
        try:  # a child that left the group could hold the pipe open: do not wait for it forever
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            out = "(output not available: a process outside the group holds the pipe)"
        who = "" if limit == timeout else f" (its own bound {timeout}s, cut to end before pytest-timeout)"
        pytest.fail(f"timed out after {limit:.0f}s{who}: {' '.join(map(str, cmd))}\n{(out or '')[-4000:]}")
    except BaseException:  # pytest-timeout, Ctrl-C: no process left behind
        kill_group(proc)
        proc.wait()
        raise
    if check and proc.returncode != 0:
        kill_group(proc)  # what it started and left behind
        pytest.fail(f"exit {proc.returncode}: {' '.join(map(str, cmd))}\n{out[-6000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out)


class TrainLog:
    """What the processes printed: losses per epoch, world size, backend, where ranks ran."""

    def __init__(self, text):
        self.text = text
        epochs = EPOCH_RE.findall(text)
        self.epochs = [int(e[0]) for e in epochs]
        self.losses = [float(e[2]) for e in epochs]
        self.world_size = int(epochs[-1][3]) if epochs else None
        # rank -> (device, backend, local rank, local world size, node, host); the last start counts
        self.ranks = {int(m[0]): (m[2], m[3], *m[4:]) for m in RANK_RE.findall(text)}
        self.backend = next(iter(self.ranks.values()))[1] if self.ranks else None  # gloo or nccl
        hosts = {place[5] for place in self.ranks.values() if place[5]}
        self.num_hosts = len(hosts) or None  # multinode.py names its hosts

    def assert_trained(self, world_size, factor=2.0):
        assert self.losses, f"no epoch lines in output:\n{self.text[-3000:]}"
        assert self.world_size == world_size, self.text[-3000:]
        assert self.losses[-1] * factor < self.losses[0], f"loss did not fall by {factor}x: {self.losses}"


def run_together(commands, *, timeout, cwd=None, env=None):
    """Start every command at once (the nodes of a job), each in a process group of its own, on the CPU,
    its output in a file (no pipe to fill while another is read); return [(exit status, output)] once all
    have ended. Past `timeout` seconds in all, every group is killed and the test fails with their output."""
    with tempfile.TemporaryDirectory() as folder:
        files = [open(os.path.join(folder, str(i)), "w+") for i in range(len(commands))]
        procs = [
            popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
            for cmd, out in zip(commands, files, strict=True)
        ]
        deadline, late = time.monotonic() + bound(timeout), False
        try:
            for proc in procs:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            late = True
        finally:
            for proc in procs:
                kill_group(proc, stacks=late)
                proc.wait()
        outs = []
        for out in files:
            out.seek(0)
            outs.append(out.read())
            out.close()
    if late:
        pytest.fail(f"not ended within {timeout} s:\n" + "\n---\n".join(out[-3000:] for out in outs))
    return [(proc.returncode, out) for proc, out in zip(procs, outs, strict=True)]


def wait_for_json(url, count, limit):
    """The JSON list a server gives at url once it holds `count` items, polled for at most `limit` s."""
    deadline, got = time.monotonic() + limit, None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                got = json.loads(response.read())
            if len(got) >= count:
                return got
        except (OSError, ValueError):
            pass
        time.sleep(1)
    raise AssertionError(f"{url} gave {got!r} within {limit} s, not {count} items")


def start_torchrun_agent(cmd, cwd, env=None):
    """Popen a torchrun that may restart its workers: they must not reuse the agent's store (torch 2.13),
    or gloo dials the old round's ports. Output in .stdout; CPU only unless env says otherwise; a process
    group of its own."""
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **(env or {})}
    return popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def doc_block(page, marker):
    """The commands of the first fenced block after `marker` in `page` (relative to the repository): what a
    test runs as the docs give it."""
    text = (REPO / page).read_text()
    return re.search(r"```(?:sh|bash)\n(.*?)```", text[text.index(marker) :], re.S).group(1)


def need(available, reason, require_var):
    """Skip when a facility (Docker, Slurm) is missing, unless require_var=1 makes that a failure."""
    if available:
        return
    if os.environ.get(require_var) == "1":
        pytest.fail(f"{reason} (and {require_var}=1)")
    pytest.skip(reason)


def example_cmd(name, *args, nproc=2, script=None, vision=False):
    """The command that starts an example the way it is meant to be started (plain, spawn or torchrun);
    vision: on ResNet-18, run by examples/vision.py (a list: with its options)."""
    port = free_port() if steps.STEPS[name] == "nodes" else None  # multinode's rendezvous
    return steps.command(name, args, nproc=nproc, script=script, port=port, root=REPO, vision=vision)[0]


def import_gpt_module(name):
    """examples/gpt/NAME.py as a module of its own (gpt_NAME), its imports found from examples/gpt; NAME
    may name a family's module: "failures.guards" is examples/gpt/failures/guards.py."""
    folder = str(EXAMPLES / "gpt")
    sys.path.insert(0, folder)
    try:
        path = EXAMPLES / "gpt" / f"{name.replace('.', '/')}.py"
        spec = importlib.util.spec_from_file_location(f"gpt_{name.replace('.', '_')}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its functions pickle by name (prepare.py's worker processes)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(folder)


# single_gpu.py's run that DDP with 2 processes of batch 32 must equal, step for step: run once per session
# (tests/lessons/test_examples.py and tests/deploy/test_ray.py compare with it). Momentum gives the optimizer
# a state.
REFERENCE_EPOCHS, REFERENCE_BATCH = 4, 64
REFERENCE_ARGS = ["--seed", "3", "--momentum", "0.9"]
EXIT_PROBE = {"PYTHONPATH": str(SITES / "exit_probe")}  # each process reports its threads at exit
# mp.spawn forks its processes from the parent that imported torch: for runs whose subject is not the start
SPAWN_BY_FORK = {"PYTHONPATH": str(SITES / "spawn_by_fork")}


def load_snapshot(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def session_dir(name):
    """A folder of this session's, the same for all its workers (a corpus one builds and the others read),
    removed when the session ends."""
    folder = session_root() / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def once_per_session(name, make):
    """(folder, make(folder)) with make run once in the session, in an empty folder, by whichever worker
    asks first while the others wait on a lock; its result (JSON) is kept beside the folder for them. A
    make that fails keeps nothing: the next to ask tries again, and fails as a test of its own."""
    folder, result = session_dir(name) / "made", session_dir(name) / "result.json"
    with open(session_dir(name) / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            made = json.dumps(make(folder))
            result.with_suffix(".tmp").write_text(made)
            result.with_suffix(".tmp").rename(result)
    return folder, json.loads(result.read_text())


def session_root():
    return Path(tempfile.gettempdir()) / f"ddp-test-{os.environ[SESSION_VAR]}"


def session_processes():
    """(pid, command line) of every process but this one that carries this session's SESSION_VAR."""
    mark = f"{SESSION_VAR}={os.environ[SESSION_VAR]}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if mark in (entry / "environ").read_bytes().split(b"\0"):
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append((int(entry.name), cmdline.strip()))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def leftover_processes():
    """Wait up to 10 s for this session's processes to end (LEFTOVER_GRACE seconds where the environment
    says: tests/repo/test_harness.py's sessions, whose leftover never ends); kill those still alive and return
    them."""
    deadline = time.monotonic() + float(os.environ.get("LEFTOVER_GRACE", 10))
    while (left := session_processes()) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left
