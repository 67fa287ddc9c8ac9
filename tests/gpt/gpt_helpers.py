"""What the GPT tests share: the trainer's paths, the tiny model, train() and the saved states compared.
The corpus cache every run reads is tests/gpt/conftest.py's fixture `cache`."""

import os
import re
import shlex

from helpers import EXAMPLES, FORKRUN, GPT_ON_PATH, PROGRAMS, PYTHON, REPO, TORCHRUN, import_gpt_module
from helpers import run as run_as_is

GPT = EXAMPLES / "gpt"
TRAIN = GPT / "train.py"
BENCH_GPT = REPO / "benchmarks" / "gpt_throughput.py"
# the benchmark's runs of 2 processes forked from one that imported torch and the trainer (its --launcher),
# where torchrun's agent and workers import them 3 times: for tests whose subject is the report
BENCH_FORKED = ["--launcher", shlex.join(map(str, FORKRUN))]
TINY = ["--n_layer", 2, "--n_head", 2, "--n_embd", 64, "--block_size", 64, "--eval_samples", 32]
TINY += ["--sample_chars", 20, "--log_every", 5, "--eval_every", 30, "--warmup_steps", 5, "--lr", 1e-3]
VAL_RE = re.compile(r"^step (\d+) \| val loss ([0-9.]+)$", re.M)


FORKSERVER = PROGRAMS / "forkserver.py"
# What the fork server adds to the session's environment (tests/gpt/conftest.py): each rank's one thread
SERVER_ENV = {"OMP_NUM_THREADS": "1"}
# What Python, torch and the libraries under it read when they start: a command line whose environment differs
# from the server's here runs as it is (the trainer's folder on PYTHONPATH excepted: the server adds it)
AT_START = ("PYTHON", "TORCH", "OMP_", "MKL_", "KMP_", "LD_", "CUDA_", "NVIDIA_", "HF_", "TRANSFORMERS_")


def run(cmd, *, env=None, **kwargs):
    """helpers.run, with a Python command line ([PYTHON, SCRIPT, ARGS...]) run by the session's fork server
    (tests/programs/forkserver.py), which has imported torch and the trainer once, where env lets it."""
    served = "FORKSERVER" in os.environ and cmd[0] == PYTHON and not str(cmd[1]).startswith("-")
    for key, value in (env or {}).items():
        if key == "PYTHONPATH" and value == GPT_ON_PATH["PYTHONPATH"]:
            continue
        served = served and not (key.startswith(AT_START) and SERVER_ENV.get(key) != value)
    return run_as_is([PYTHON, "-I", "-S", FORKSERVER, *cmd[1:]] if served else cmd, env=env, **kwargs)


def train(cwd, cache, *args, nproc=None, script=None, torchrun=False, timeout=600, check=True, env=None):
    """train.py (or a script that runs it) on the tiny model: alone (1 thread, as each rank has), or on
    nproc processes forked in torchrun's environment (FORKRUN), or under torchrun itself where what it
    does is the subject (torchrun=True: its closing summary)."""
    env = {"OMP_NUM_THREADS": "1", **(GPT_ON_PATH if script else {}), **(env or {})}
    launcher = [*TORCHRUN, "--standalone"] if torchrun else FORKRUN
    cmd = [*launcher, f"--nproc-per-node={nproc}"] if nproc else [PYTHON]
    cmd += [script, TRAIN] if script else [TRAIN]
    cmd += ["--cache_dir", cache, *TINY, *args]
    return run(cmd, timeout=timeout, cwd=cwd, check=check, env=env)


def saved(folder, name="gpt_snapshot"):
    """The snapshot directory folder/name as one process holds it: what export.py writes in one file."""
    return import_gpt_module("export").single_file_state(folder / name)


def files(folder):
    """{path: bytes} of every file under folder."""
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def gap(a, b):
    """The relative L2 distance of two saved models' trained weights (not the head's frozen padding bias)."""
    keys = [k for k in b if k != "head.bias"]
    return (sum((a[k] - b[k]).square().sum() for k in keys) / sum(b[k].square().sum() for k in keys)).sqrt()


def moved(mine, dropped, plain):
    """How far a dropout run's weights (mine) moved from the run without dropout (plain), in units of how
    far a reference dropout run (dropped) moved: masks differ between them, the distance from plain not."""
    return gap(mine, plain) / gap(dropped, plain)


def assert_close(mine, ref, tolerance=1e-4):
    """Two runs' saved states (saved()) equal within float summation order, amplified by AdamW: the weights
    and the optimizer state, whose moments see a gradient off by a constant factor that the weights do
    not (AdamW divides it out), where every step is unclipped (--grad_clip 0)."""
    assert mine["model"].keys() == ref["model"].keys()
    diff = max_diff(mine["model"], ref["model"])
    assert diff < tolerance, f"parameters {diff:.3g} apart"
    assert mine["optimizer"]["param_groups"] == ref["optimizer"]["param_groups"]
    assert mine["optimizer"]["state"].keys() == ref["optimizer"]["state"].keys()
    for name, state in ref["optimizer"]["state"].items():
        for key, value in state.items():  # relative to the size of each moment: exp_avg_sq is about 1e-6
            scale = max(value.abs().max().item(), 1e-12)
            diff = (mine["optimizer"]["state"][name][key] - value).abs().max().item() / scale
            assert diff < tolerance * 10, f"optimizer state {name}.{key}: {diff:.3g} apart, relatively"


def assert_identical(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].equal(b[key]), key


class RunsCode:
    """Unpickled, it runs a command: `touch pwned` in the working folder."""

    def __reduce__(self):
        return (os.system, ("touch pwned",))


def assert_stopped_and_resumed_ends_bit_identical(tmp_path, cache, args, stop, end, nproc=None):
    """A run stopped at step `stop` and resumed to `end` ends with the model and optimizer state of one run
    straight to `end`."""
    (tmp_path / "full").mkdir()
    train(tmp_path / "full", cache, *args, "--max_steps", end, nproc=nproc)
    train(tmp_path, cache, *args, "--max_steps", stop, nproc=nproc)
    proc = train(tmp_path, cache, *args, "--max_steps", end, nproc=nproc)
    assert f"resuming from gpt_snapshot at step {stop}" in proc.stdout, proc.stdout[-2000:]
    full, resumed = (
        saved(tmp_path / "full"),
        saved(tmp_path),
    )
    assert resumed["step"] == end
    assert_identical(full["model"], resumed["model"])
    for a, b in zip(full["optimizer"]["state"].values(), resumed["optimizer"]["state"].values(), strict=True):
        assert_identical(a, b)
