"""Shared helpers for the test suite: paths, running commands with a bound, reading the examples' output."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import steps  # noqa: E402  (tools/steps.py: how each step is started, shared with the Makefile and the bench)

free_port = steps.free_port
EXAMPLES = REPO / "examples"
PYTHON = sys.executable
TORCHRUN = [PYTHON, "-m", "torch.distributed.run"]
VENV = Path(PYTHON).parent.parent  # the environment running the tests, handed to make as VENV

# The lessons' log lines; `make multinode` prefixes each node's output with "[nodeN] ". Rank 0, each epoch:
NODE = r"^(?:\[\w+\] )?"
EPOCH_RE = re.compile(NODE + r"epoch (\d+)/(\d+) \| loss ([0-9.eE+-]+) \| .*\| world_size (\d+)$", re.M)
# rank 0 at the end of a DDP run
FINAL_RE = re.compile(NODE + r"weights identical on (\d+) of (\d+) ranks$", re.M)
# every DDP process at its start; multinode.py adds its place: local rank, node and host. Not anchored: two
# processes printing at once can put one's line break after the other's line.
RANK_RE = re.compile(
    r"\[rank (\d+)/(\d+)\] ([^,\s]+), ([a-z]+)(?:, local rank (\d+)/(\d+) on node (\d+) \(([^)\s]+)\))?"
)

# Ray prints `(RayTrainWorker pid=123) ` (colored; `, ip=...` when from another node) before an actor's lines
RAY_PREFIX_RE = re.compile(r"^(?:\x1b\[\d+m)?\(\w+ pid=(\d+)(?:, ip=[\d.]+)?\)(?:\x1b\[0m)? ", re.M)


def without_ray_prefixes(text):
    """The lines of Ray's actors (examples/multigpu_ray.py) as the lessons print them."""
    return RAY_PREFIX_RE.sub("", text)


def assert_world(text, per_host):
    """The rank lines in text (the output of every node) describe one world of sum(per_host.values())
    processes, per_host[name] of them on the node whose host name is name: each global rank once, every
    node with local ranks 0..n-1 and the block of global ranks that follows the nodes of lower GROUP_RANK
    (whichever node that is: the rendezvous decides); and rank 0 says the replicas ended identical."""
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
    identical = FINAL_RE.search(text)
    assert identical and int(identical.group(1)) == world, f"replicas not shown identical:\n{text[-3000:]}"


# The GPUs this test run may use. Commands run on the CPU unless a test passes env=GPU_ENV; the tests that
# do are marked needs_gpu and skipped where torch sees no GPU, as in CI.
GPUS = torch.cuda.device_count()
GPU_ENV = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(GPUS)))}
needs_gpu = pytest.mark.skipif(not GPUS, reason="no CUDA GPU visible to torch")


def run(cmd, *, timeout, check=True, env=None, **kwargs):
    """Run cmd, capture stdout+stderr as text, fail the test with the output on error or timeout."""
    # CPU only by default, so that the same assertions hold on a machine with GPUs (2 processes on 1 GPU)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    try:
        proc = subprocess.run(
            [str(c) for c in cmd],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            env=full_env,
            **kwargs,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        pytest.fail(f"timed out after {timeout}s: {' '.join(map(str, cmd))}\n{out[-4000:]}")
    if check and proc.returncode != 0:
        pytest.fail(f"exit {proc.returncode}: {' '.join(map(str, cmd))}\n{proc.stdout[-6000:]}")
    return proc


class TrainLog:
    """What the processes printed: losses per epoch, world size, backend, where ranks ran, the final check."""

    def __init__(self, text):
        self.text = text
        epochs = EPOCH_RE.findall(text)
        self.epochs = [int(e[0]) for e in epochs]
        self.losses = [float(e[2]) for e in epochs]
        self.world_size = int(epochs[-1][3]) if epochs else None
        final = FINAL_RE.search(text)
        # a single process prints no final check: it is trivially in sync with itself
        self.ranks_in_sync = int(final.group(1)) if final else (1 if epochs else None)
        # rank -> (device, backend, local rank, local world size, node, host); the last start counts
        self.ranks = {int(m[0]): (m[2], m[3], *m[4:]) for m in RANK_RE.findall(text)}
        self.backend = next(iter(self.ranks.values()))[1] if self.ranks else None  # gloo or nccl
        hosts = {place[5] for place in self.ranks.values() if place[5]}
        self.num_hosts = len(hosts) or None  # multinode.py names its hosts

    def assert_trained(self, world_size, factor=2.0):
        assert self.losses, f"no epoch lines in output:\n{self.text[-3000:]}"
        assert self.world_size == world_size, self.text[-3000:]
        assert self.ranks_in_sync == world_size, f"ranks did not end in sync:\n{self.text[-3000:]}"
        assert self.losses[-1] * factor < self.losses[0], f"loss did not fall by {factor}x: {self.losses}"


def start_torchrun_agent(cmd, cwd, env=None):
    """Popen a torchrun that may restart its workers: they must not reuse the agent's store (torch 2.13),
    or gloo dials the old round's ports. Output in .stdout; CPU only unless env says otherwise."""
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    return subprocess.Popen(
        [str(c) for c in cmd], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


def need(available, reason, require_var):
    """Skip when a facility (Docker, Slurm) is missing, unless require_var=1 makes that a failure."""
    if available:
        return
    if os.environ.get(require_var) == "1":
        pytest.fail(f"{reason} (and {require_var}=1)")
    pytest.skip(reason)


def example_cmd(name, *args, nproc=2, script=None):
    """The command that starts an example the way it is meant to be started (plain, spawn or torchrun)."""
    return steps.command(name, args, nproc=nproc, script=script, root=REPO)[0]


def import_gpt_module(name):
    """examples/gpt/NAME.py as a module of its own (gpt_NAME), its imports found beside it."""
    folder = str(EXAMPLES / "gpt")
    sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location(f"gpt_{name}", EXAMPLES / "gpt" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(folder)


def load_snapshot(path):
    return torch.load(path, map_location="cpu", weights_only=True)
