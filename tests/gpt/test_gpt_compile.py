"""--compile: each block's forward compiled (parallel.apply_compile) in one process and under ddp, fsdp, tp
and pp, with the layout matrix's other axes in turn (CASES: bf16, fp16, --ac, --grad_accum and dropout,
whose masks inductor draws from its own generator, so that its compiled run is compared as the matrix
compares dropout runs; tp refuses --ac under compile). By torch's own logs no frame falls back to eager: no
graph break, and dynamo compiles the blocks' forward and nothing else; the compiled run ends where the eager
one ends, under the same names, and in one process an eager run resumes from its snapshot. In one process
the compiled run recomputes its activations too (--ac full), against the eager run without them: activation
checkpointing under compile breaks no graph and trains alike (7.5e-7 apart after 5 steps). About 4 minutes
on 2 cores, inductor's cache cold as in a fresh clone."""

import re
from pathlib import Path

import pytest
import torch
from gpt_helpers import gap, max_diff, moved, saved, train
from helpers import import_gpt_module

SMALL = ["--n_layer", 2, "--n_embd", 32, "--n_head", 2, "--block_size", 16, "--batch_size", 4]
SMALL += ["--max_steps", 5, "--eval_every", 5, "--sample_chars", 0]
# The layout matrix's other axes in turn, eager and compiled alike, so that --compile meets each of their
# values (one process adds --ac full to its compiled run alone). Every graph inductor compiles cold is the
# cost: ddp, fsdp and pp share one, so the 16-bit types, --ac selective and dropout go to tp and a second
# process of one
CASES = {  # name: (processes, options)
    "one process": (None, []),
    "one process, fp16": (None, ["--dtype", "fp16", "--ac", "selective", "--dropout", 0.1]),
    "ddp": (2, ["--parallel", "ddp", "--grad_accum", 2]),
    "fsdp": (2, ["--parallel", "fsdp"]),
    "tp": (2, ["--parallel", "tp", "--dtype", "bf16"]),  # --ac refused with tp under compile
    "pp": (2, ["--parallel", "pp"]),
}
# dropout: a compiled run draws its masks from inductor's generator, so it cannot equal the eager run; as in
# the layout matrix, it must move as far from a run without dropout as the eager run with it does: 0.98
# measured under pp (2026-12-03). The blocks' dropout lost under compile leaves the embeddings': 0.80.
DROPOUT_RATIO = (0.9, 1.1)
# TORCH_LOGS=graph_breaks: a record per graph break, each opening "Graph break"; TORCH_LOGS=dynamo: a line per
# frame dynamo compiles, "torchdynamo start tracing forward /path/model.py:98"
GRAPH_BREAK_RE = re.compile(r"\[__graph_breaks\] Graph break")
TRACED_RE = re.compile(r"torchdynamo start tracing (\w+) (\S+):(\d+)$", re.M)
OPENING_RE = re.compile(
    r"process\(es\) on cpu, (\w+)( \(emulated by this CPU: float32 is faster\))?, attention"
)


@pytest.mark.parametrize("layout", CASES)
def test_each_block_compiles_without_a_graph_break_and_trains_as_eager(tmp_path, cache, layout):
    """Mutation: the whole model compiled instead (model.compile()): under fsdp 6 graph breaks, 3 a rank
    (FSDP's hooks, which dynamo never traces, inside the loop over the blocks); under tp the first backward
    fails; in one process, ddp and pp dynamo compiles GPT's forward, not the blocks'. Each fails here."""
    nproc, options = CASES[layout]
    args = [*SMALL, *options]
    (tmp_path / "eager").mkdir()
    train(tmp_path / "eager", cache, *args, nproc=nproc)
    ac = ["--ac", "full"] if layout == "one process" else []  # recomputed activations compile too
    logs = {"TORCH_LOGS": "graph_breaks,dynamo"}
    proc = train(tmp_path, cache, *args, "--compile", *ac, nproc=nproc, env=logs)
    breaks = len(GRAPH_BREAK_RE.findall(proc.stdout))
    print(f"{layout}: {breaks} graph breaks")
    assert breaks == 0, proc.stdout[-6000:]
    block = import_gpt_module("model").Block.forward.__code__
    traced = {(name, Path(path).name, int(line)) for name, path, line in TRACED_RE.findall(proc.stdout)}
    assert traced == {("forward", "model.py", block.co_firstlineno)}, traced
    # the start-up line names the type, and says where this CPU emulates it (model.cpu_emulates)
    asked = options[options.index("--dtype") + 1] if "--dtype" in options else "fp32"
    said = OPENING_RE.search(proc.stdout)
    assert said, proc.stdout[-4000:]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[asked]
    assert said.group(1) == str(dtype).removeprefix("torch."), said.group(0)
    assert bool(said.group(2)) == import_gpt_module("model").cpu_emulates(dtype), said.group(0)
    compiled, eager = saved(tmp_path)["model"], saved(tmp_path / "eager")["model"]
    assert compiled.keys() == eager.keys()  # a snapshot loads across compiled and eager runs
    # the compiled kernels add in another order: float rounding, 5e-7 to 1e-6 measured after 5 steps; in
    # 16 bits inductor rounds elsewhere too: relative distances 1e-4 to 3e-4 measured
    if "--dropout" in options:
        (tmp_path / "plain").mkdir()
        train(tmp_path / "plain", cache, *args, "--dropout", 0, nproc=nproc)  # the last value given counts
        plain = saved(tmp_path / "plain")["model"]
        ratio = moved(compiled, eager, plain)
        print(f"{layout}: the compiled run moved {ratio:.3g} times as far from no dropout as the eager run")
        assert DROPOUT_RATIO[0] < ratio < DROPOUT_RATIO[1]
    elif "--dtype" in options:
        apart = gap(compiled, eager)
        print(f"{layout}: compiled and eager parameters {apart:.3g} apart (relative) after 5 steps")
        assert apart < 2e-3
    else:
        diff = max_diff(compiled, eager)
        print(f"{layout}: compiled and eager parameters {diff:.3g} apart after 5 steps")
        assert diff < 1e-5
    if layout == "one process":  # the compiled run's snapshot resumes in an eager one
        resumed = train(tmp_path, cache, *args, "--max_steps", 6)  # the last value given counts
        assert "resuming from gpt_snapshot at step 5" in resumed.stdout, resumed.stdout[-2000:]
