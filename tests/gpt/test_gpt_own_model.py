"""docs/gpt.md "Your own model": a model other than model.py's GPT, defined here, trains under ddp, fsdp
and tp on 2 processes through what the docs say (a class that GPT's interface, given to trainer.GPT)."""

import re

import pytest
import torch
from gpt_helpers import TINY, TRAIN, run
from helpers import FORKRUN, GPT_ON_PATH, PROGRAMS, import_gpt_module
from torch.distributed import checkpoint as dcp

VAL_RE = re.compile(r"^step (\d+) \| val loss ([0-9.]+)$", re.M)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "tp"])
def test_a_model_of_your_own_trains_under_each_strategy(tmp_path, cache, strategy):
    cmd = [*FORKRUN, "--nproc-per-node=2", PROGRAMS / "own_model.py", TRAIN]
    cmd += ["--cache_dir", cache, *TINY]
    cmd += ["--parallel", strategy, "--max_steps", 10, "--eval_every", 10, "--batch_size", 4]
    proc = run(cmd, timeout=900, cwd=tmp_path, env={**GPT_ON_PATH, "OMP_NUM_THREADS": "1"})
    step_dir = next((tmp_path / "gpt_snapshot").glob("step-*"))
    names = list(dcp.FileSystemReader(step_dir).read_metadata().state_dict_metadata)
    assert any("blocks.1.ln1" in name for name in names), names  # the own model's weights were trained
    assert not any("ln2" in name for name in names), names  # model.py's GPT has a second norm per block
    losses = [float(v) for _, v in VAL_RE.findall(proc.stdout)]
    assert losses and losses[-1] < 4.0, proc.stdout[-2000:]  # below ln(96) = 4.56: it learns
    # the buffer holds what init_buffers() gave it on every process, not what to_empty left there
    assert proc.stdout.count("buffer values [0.5]") == 2, proc.stdout[-2000:]
    if strategy == "ddp":
        assert "replicas identical" in proc.stdout


def test_a_buffer_without_init_buffers_is_named():
    """Mutation: init_buffers() skipping the check: the model trains on garbage and this fails."""
    model = import_gpt_module("model")
    with torch.device("meta"):
        gpt = model.GPT(model.GPTConfig(vocab_size=8, n_layer=1, n_head=2, n_embd=8))
        gpt.blocks["0"].register_buffer("mask", torch.ones(4))
    gpt.to_empty(device="cpu")
    with pytest.raises(TypeError, match=r"buffers \['blocks.0.mask'\] cannot be filled: give their module"):
        model.init_buffers(gpt)
