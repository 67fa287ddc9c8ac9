"""The GPT trainer's whole layout space: every combination its options accept (each mesh dimension's
degree, --pp_schedule, --parallel zero, --dtype; bf16 and fp16, --ac's modes, --grad_accum 1 and 2 and
--dropout 0 and 0.1 pairwise with the rest: every pair of values in a run, not their product) on 4 processes
(degrees up to 4: the 1-D and 2-D forms) and on 8 (degrees up to 2: the 3-D forms) trains and ends where
one process ends, or is refused before step 1 in one line. The space is read from the options by
tests/programs/layout_matrix.py, which trains each combination in one launch per world size (the two on
both workers, one process's run shared by them): about 6 minutes of 2 cores, the suite's costliest file,
since the space is the subject; bf16 and fp16 need their 20 steps (see BF16_SHARE). fp16 runs as on a
GPU: CPU autocast and the trainer's loss scale (failures/guards.LossScaler), refused only with a
pipeline, which has no scaler. A run with dropout cannot equal one process's (each share of the batch
draws its own masks): it must keep its replicas identical and move as far as one process's (DROPOUT_RATIO).
Not here: --compile (tests/gpt/test_gpt_compile.py, with the other axes in turn: its compile time per
layout would be the matrix's)."""

import itertools
import json
import re

import pytest
from gpt_helpers import assert_close, gap, max_diff, moved, run, saved
from helpers import FORKRUN, GPT_ON_PATH, PROGRAMS, import_gpt_module, once_per_session

STEPS = {"fp32": 3, "bf16": 20, "fp16": 20}
# 4 layers and 4 heads: 4 pipeline stages, 4 tensor-parallel shares; global batch 8 in every layout
ARGS = ["--n_layer", 4, "--n_head", 4, "--n_embd", 32, "--block_size", 16, "--eval_samples", 8]
ARGS += ["--sample_chars", 0, "--grad_clip", 0, "--lr", 3e-3, "--warmup_steps", 0]
# fp16: tp's head takes its weight's gradient from whole logits (loss_parallel), in fp16 and scaled, where
# one process's chunked loss scales after its matmuls: at GPT's 65536, 8 processes of 2 sequences each
# overflow at step 3 and skip it, one process does not. From 1024 no layout overflows, so all compare.
ARGS += ["--loss_scale", 1024]
COMBO_RE = re.compile(r"^COMBO (\S+) (trained|refused) (.*)$", re.M)
# a combination's name: its shape, schedule and zero, then the values that join pairwise
NAME_RE = re.compile(
    r"^(?P<shape>[^-]+)(-gpipe|-1f1b)?(-zero)?-(?P<dtype>\w+)-ac_(?P<ac>\w+)-accum(?P<accum>\d)"
    r"-dropout(?P<dropout>[0-9.]+)$"
)
PAIRWISE = ["shape", "dtype", "ac", "accum", "dropout"]
VAL_RE = re.compile(r"\| val loss ([0-9.]+) \|")
REPLICAS_RE = re.compile(r"torch\.float32 \| (replicas identical: \d+ copies|no weights are replicated) ")
# bf16: a layout rounds in other places than one process does (FSDP's bf16 copies of the norms and the
# embeddings, sums over other shares). Its weights after 20 steps must be far closer to one process's bf16
# run than that run is to one process's fp32 run: measured 2026-11-29, 0.004-0.008 against 0.13 (relative
# L2 distances), so at most a tenth of it. docs/parallelism.md states this bound.
BF16_SHARE = 0.1
# dropout: each share of the batch draws its own masks, so no layout's run equals one process's; the copies
# of a part still agree (the replica check: tensor-parallel processes draw alike), and its weights move as
# far from the run without dropout as one process's dropout run does: measured 2026-12-03, 0.95-1.03 times
# (masks alone part two dropout runs by 1.15-1.25 times that distance). Dropout ignored moves them 0 times.
DROPOUT_RATIO = (0.8, 1.25)


def matrix(tmp_path, cache, world, most):
    """{combination: (trained or refused, the rest of its line)} for this world size."""
    cmd = [*FORKRUN, f"--nproc-per-node={world}", PROGRAMS / "layout_matrix.py"]
    cmd += [tmp_path / f"w{world}", most, 8, json.dumps(STEPS), "--", "--cache_dir", cache, *ARGS]
    proc = run(cmd, timeout=900, cwd=tmp_path, env={**GPT_ON_PATH, "OMP_NUM_THREADS": "1"})
    combos = {name: (verdict, rest) for name, verdict, rest in COMBO_RE.findall(proc.stdout)}
    assert combos, proc.stdout[-3000:]
    return combos


@pytest.fixture(scope="module")
def one(cache):
    """One process through the same program: fp32, bf16 and fp16; once in the session, for both world
    sizes, whichever worker runs them."""
    return once_per_session("layout-matrix-one", lambda folder: matrix(folder, cache, 1, 1))


@pytest.mark.parametrize(("world", "most"), [(4, 4), (8, 2)])
def test_every_layout_trains_like_one_process_or_is_refused_in_one_line(tmp_path, cache, one, world, most):
    """Over a minute: every combination of its world size, 4 or 8 processes on 2 cores (2.5 min each in a
    whole run); bf16 needs its 20 steps."""
    combos = matrix(tmp_path, cache, world, most)
    runs = {name: NAME_RE.match(name).groupdict() for name in combos}
    dtypes = {run["dtype"] for run in runs.values()}
    assert dtypes == {"fp32", "bf16", "fp16"}, dtypes  # auto is fp32 on a CPU
    trained = [name for name, (verdict, _) in combos.items() if verdict == "trained"]
    print(f"{len(combos)} combinations on {world} processes, {len(trained)} trained")
    refs = references(one)
    for name, (verdict, rest) in combos.items():
        dtype, pipeline = runs[name]["dtype"], "pp" in name
        if verdict == "refused":  # argparse's one line; zero's and a pipeline's fp16 and accumulation
            assert rest.startswith("layout_matrix.py: error: --"), (name, rest)
            assert "zero" in name or (pipeline and (dtype == "fp16" or runs[name]["accum"] != "1")), (
                name,
                rest,
            )
            continue
        # float32 between the blocks in every process; copies of a part equal (fsdp alone holds none)
        assert REPLICAS_RE.match(rest), (name, rest)
        assert rest.endswith(" | hooks once a micro-batch: True"), (
            name,
            rest,
        )  # a pipeline's wraps a private method
        ref = saved(one[0] / "w1", refs[dtype, "0.0"])
        mine = saved(tmp_path / f"w{world}", name)
        assert mine["step"] == STEPS[dtype] == ref["step"], name
        if runs[name]["dropout"] != "0.0":  # its own masks: as far from no dropout as one process goes
            dropped = saved(one[0] / "w1", refs[dtype, runs[name]["dropout"]])
            ratio = moved(mine["model"], dropped["model"], ref["model"])
            print(f"{name}: moved {ratio:.3g} times as far from no dropout as one process's dropout run")
            assert DROPOUT_RATIO[0] < ratio < DROPOUT_RATIO[1], (name, ratio)
        elif dtype == "fp32":
            assert_close(mine, ref, tolerance=1e-5)
            print(f"{name}: {max_diff(mine['model'], ref['model']):.2g} from one process after 3 steps")
            # the validation loss too: every process evaluates its share of the same samples
            val = float(VAL_RE.search(rest).group(1))
            ref_val = float(VAL_RE.search(one[1][refs["fp32", "0.0"]][1]).group(1))
            assert abs(val - ref_val) < 1e-3, (name, val, ref_val)  # printed to 4 decimals
        else:
            scale = gap(ref["model"], saved(one[0] / "w1", refs["fp32", "0.0"])["model"])
            apart = gap(mine["model"], ref["model"])
            print(f"{name}: {apart:.2g} from one process's {dtype} run, which is {scale:.2g} from fp32's")
            assert apart < BF16_SHARE * scale, (name, apart, scale)
    # every shape of this world size trained, each pipeline one with every schedule, and the composition
    # of pipeline and tensor parallel among them (4: pp2xtp2; 8: with a data-parallel dimension too)
    shapes = {name.split("-")[0] for name in trained}
    assert len(shapes) == {4: 10, 8: 4}[world], sorted(shapes)
    schedules = {}
    for name in trained:
        shape, *parts = name.split("-")
        if "pp" in shape:
            schedules.setdefault(shape, set()).add(parts[0])
    assert len({frozenset(s) for s in schedules.values()}) == 1 and len(next(iter(schedules.values()))) > 1
    composed = {
        shape for shape in schedules if "tp" in shape and len(shape.split("x")) == {4: 2, 8: 3}[world]
    }
    assert composed, sorted(shapes)
    # pairwise: every pair of values of shape, type, --ac and --grad_accum met in a run that trained, or
    # refused in one line for that pair (not for zero); the pairs without a shape on 4 processes (on 8 one
    # shape has no pipeline: 3 runs train fp16 or accumulate)
    values = {f: {run[f] for run in runs.values()} for f in PAIRWISE}
    assert values["ac"] == set(import_gpt_module("ac").MODES) and values["accum"] == {"1", "2"}, values
    assert values["dropout"] == {"0.0", "0.1"}, values
    for a, b in itertools.combinations(PAIRWISE, 2):
        if world == 8 and "shape" not in (a, b):
            continue
        every = set(itertools.product(values[a], values[b]))
        met = {
            (runs[n][a], runs[n][b])
            for n, (verdict, _) in combos.items()
            if verdict == "trained" or "zero" not in n
        }
        assert every <= met, (a, b, sorted(every - met))


def references(one):
    """{type: the name of one process's run in it}, zero's left out: what each layout's run is compared to."""
    trained = [name for name, (verdict, _) in one[1].items() if verdict == "trained" and "zero" not in name]
    refs = {(NAME_RE.match(name)["dtype"], NAME_RE.match(name)["dropout"]): name for name in trained}
    assert len(refs) == len(trained) and {t for t, _ in refs} == {"bf16", "fp16", "fp32"}, trained
    return refs
