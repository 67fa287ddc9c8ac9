"""The GPT trainer's memory options: gradients that stay sharded under accumulation (FSDP2 reduce-scatters
every micro-batch), activation checkpointing (--ac) on several layouts (under --compile:
test_gpt_compile.py), pp x FSDP that gathers each block once a step with a dropout stream per stage, and
initial values cut on the CPU. Every run trains unclipped (--grad_clip 0), so a wrong gradient scale shows
in the weights and the AdamW state. Tiny model, a few steps each.

And the memory meter (examples/gpt/observability/memory.py) with the report of benchmarks/gpt_memory.py built
on it: its counts per rank against a direct count, under DDP and FSDP2, and its refusals. The report's runs:
under 60 s (49 s on 2 shared cores at load average 2 to 3, 110 s at 4 to 5; each torchrun start imports torch
three times)."""

import json
import re

import pytest
import torch
from gpt_helpers import max_diff, run, saved, train
from helpers import EXAMPLES, FORKRUN, GPT_ON_PATH, PROGRAMS, PYTHON, REPO, import_gpt_module

# global batch 16 in every run: 1 x 16, 2 processes x 2 sequences x 4 micro-batches, ...
STEPS = [
    "--max_steps",
    6,
    "--save_every",
    6,
    "--eval_every",
    6,
    "--grad_clip",
    0,
    "--metrics_path",
    "m.jsonl",
]
ACCUM = ["--parallel", "fsdp", "--batch_size", 2, "--grad_accum", 4]


def assert_same_state(a, b, tolerance):
    """Weights and AdamW state of two runs' snapshots (as one process holds them) within tolerance."""
    assert a["step"] == b["step"] and a["model"].keys() == b["model"].keys()
    diffs = {"weights": max_diff(a["model"], b["model"])}
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for name, state in a["optimizer"]["state"].items():
        diffs[name] = max_diff(state, b["optimizer"]["state"][name])
    print(f"largest differences: weights {diffs['weights']:.3g}, AdamW state {max(diffs.values()):.3g}")
    assert max(diffs.values()) <= tolerance, diffs


def memory_records(folder):
    records = [json.loads(line) for line in (folder / "m.jsonl").read_text().splitlines()]
    return [r["memory"] for r in sorted((r for r in records if "memory" in r), key=lambda r: r["rank"])]


@pytest.fixture(scope="module")
def one(tmp_path_factory, cache):
    cwd = tmp_path_factory.mktemp("one")
    train(cwd, cache, *STEPS, "--batch_size", 16)
    return cwd


@pytest.fixture(scope="module")
def accum(tmp_path_factory, cache):
    cwd = tmp_path_factory.mktemp("accum")
    train(cwd, cache, *STEPS, *ACCUM, nproc=2)
    return cwd


# ---- accumulation under FSDP: gradients reduce-scattered every micro-batch -----------------------------
def assert_gradients_sharded_and_one_process(cwd, one, replicas):
    whole = memory_records(one)[0]
    ranks = memory_records(cwd)
    # counted after every micro-batch's backward: each process holds the gradients of its shards only, and
    # the shards of one replica add up to the model's; the head's frozen padding bias has no gradient
    frozen = whole["params_bytes"] - whole["grads_bytes"]
    assert frozen == 0, whole  # 96 characters, under 4096: no padding rows, no frozen bias
    shards = len(ranks) // replicas
    assert [m["params_bytes"] - m["grads_bytes"] for m in ranks] == [frozen // shards] * len(ranks), ranks
    assert sum(m["grads_bytes"] for m in ranks) == replicas * whole["grads_bytes"], ranks
    assert_same_state(saved(cwd), saved(one), 1e-5)


def test_fsdp_accumulation_keeps_gradients_sharded_and_equals_one_process(accum, one):
    assert len(memory_records(accum)) == 2
    assert_gradients_sharded_and_one_process(accum, one, replicas=1)


def test_hsdp_accumulation_keeps_gradients_sharded_and_equals_one_process(tmp_path, cache, one):
    # 2 replicas of 2 shards, 1 sequence x 4 micro-batches each: only the replicas' all-reduce waits
    args = ["--dp_replicate", 2, "--dp_shard", 2, "--batch_size", 1, "--grad_accum", 4]
    train(tmp_path, cache, *STEPS, *args, nproc=4)
    assert len(memory_records(tmp_path)) == 4
    assert_gradients_sharded_and_one_process(tmp_path, one, replicas=2)


# ---- activation checkpointing: the same run, fewer activations kept -------------------------------------
def saved_activation_bytes(mode, every=2):
    """Bytes autograd keeps for backward in one forward of a small GPT with --ac mode."""
    model_mod, ac = import_gpt_module("model"), import_gpt_module("ac")
    cfg = model_mod.GPTConfig(vocab_size=16, block_size=32, n_layer=4, n_head=2, n_embd=32)
    model = model_mod.GPT(cfg)
    model.init_weights(seed=0)
    ac.apply_ac(model, mode, every)
    weights, kept = {p.data_ptr() for p in model.parameters()}, {}

    def pack(tensor):  # the weights (or views of them) saved for backward are not activations
        if tensor.data_ptr() not in weights:
            kept[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
        return tensor

    idx = torch.randint(16, (4, 32))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx)[1]
    return sum(kept.values())


def test_ac_keeps_fewer_activations_for_backward():
    none, every2, full = (saved_activation_bytes(m) for m in ("none", "selective", "full"))
    print(f"activations kept for backward: none {none}, selective every 2: {every2}, full {full}")
    assert full < every2 < none
    assert saved_activation_bytes("selective", every=1) == full


@pytest.mark.parametrize(
    ("name", "args", "nproc"),
    [
        ("fsdp x accumulation, full", [*ACCUM, "--ac", "full"], 2),
        ("one process, selective", ["--batch_size", 16, "--ac", "selective", "--ac_every", 2], None),
    ],
)
def test_ac_equals_ac_none(tmp_path, cache, accum, one, name, args, nproc):
    train(tmp_path, cache, *STEPS, *args, nproc=nproc)
    assert_same_state(saved(tmp_path), saved(accum if nproc else one), 1e-6)


# global batch 16 in each, as `one`: processes, the layout, the --ac mode (selective: the second of the 2
# blocks recomputes); each mode on a replicated and on a sharded layout, one and two dimensions
AC_LAYOUTS = {
    "ddp": (2, ["--parallel", "ddp", "--batch_size", 8], "full"),
    "tp": (2, ["--parallel", "tp", "--batch_size", 16], "selective"),
    "hsdp": (4, ["--dp_replicate", 2, "--dp_shard", 2, "--batch_size", 4], "selective"),
    "fsdp x tp": (4, ["--dp_shard", 2, "--tp", 2, "--batch_size", 8], "full"),
}


@pytest.mark.parametrize("layout", AC_LAYOUTS)
def test_ac_on_each_layout_trains_as_one_process(tmp_path, cache, one, layout):
    """The layout without --ac equals one process in tests/gpt/test_gpt_layouts.py; with it, here, too."""
    nproc, args, mode = AC_LAYOUTS[layout]
    train(tmp_path, cache, *STEPS, *args, "--ac", mode, nproc=nproc)
    assert_same_state(saved(tmp_path), saved(one), 1e-5)


def test_ac_under_pp_with_dropout_recomputes_the_same_masks(tmp_path, cache):
    args = [*STEPS, "--parallel", "pp", "--batch_size", 16, "--pp_microbatches", 4, "--dropout", 0.1]
    (tmp_path / "none").mkdir()
    train(tmp_path / "none", cache, *args, nproc=2)
    train(tmp_path, cache, *args, "--ac", "full", nproc=2)
    assert_same_state(saved(tmp_path), saved(tmp_path / "none"), 1e-6)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ac", "full", "--ac_every", "2"], "--ac_every is for --ac selective (this run: --ac full)"),
        (["--ac", "selective", "--ac_every", "0"], "--ac_every must be positive, got 0"),
        (["--ac", "some"], "argument --ac: invalid choice: 'some'"),
    ],
)
def test_bad_ac_options_get_an_argparse_error(capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        import_gpt_module("config").parse_args(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


# ---- pp x FSDP and initialisation, on 4 processes, without the trainer ---------------------------------
def probe(tmp_path, kind):
    cmd = [*FORKRUN, "--nproc-per-node=4", PROGRAMS / "memory_probe.py", kind]
    proc = run(cmd, timeout=180, cwd=tmp_path, env=GPT_ON_PATH)
    return next((line for line in proc.stdout.splitlines() if line.startswith("RESULT")), proc.stdout[-2000:])


def test_pp_x_fsdp_gathers_each_block_once_with_dropout_per_stage(tmp_path):
    # each stage holds two FSDP units (its block, and the root's embedding or final norm and head): one
    # all-gather each per step, whatever the micro-batches (10 with resharding after every forward)
    """pp x FSDP gathers each block once a step and each stage draws its own dropout."""
    assert probe(tmp_path, "pp") == "RESULT distinct all-gathers 2"


def test_fsdp_keeps_the_last_block_gathered_into_its_backward(tmp_path):
    """FSDP keeps the last block gathered from its forward to its backward.

    Forward gathers the root's parameters (embeddings, final norm, head) and both blocks; backward
    gathers again all but the last block, which backward starts with: 5 all-gathers a step, 6 when every
    unit reshards after its forward (the mutation: this fails)."""
    assert probe(tmp_path, "fsdp") == "RESULT all-gathers 5"


def test_initial_values_are_cut_on_the_cpu_a_parameter_at_a_time(tmp_path):
    """Initial values are cut on the CPU one whole parameter at a time and equal one process."""
    assert probe(tmp_path, "init") == "RESULT equal, at most 0 other whole value alive"


# The memory meter and benchmarks/gpt_memory.py's report (once tests/test_memory.py)
TOOL = REPO / "benchmarks" / "gpt_memory.py"
TINY = ["--n_layer", 1, "--n_head", 2, "--n_embd", 32, "--block_size", 16, "--batch_size", 4]


def gpt_parameter_tensors(vocab_size):
    """The GPT of TINY's shape (the cpu preset's: no biases), built here: its parameters, the tied
    embedding and head weight once."""
    model = import_gpt_module("model")
    cfg = model.GPTConfig(vocab_size=vocab_size, n_layer=1, n_head=2, n_embd=32, block_size=16, bias=False)
    return list(model.GPT(cfg).parameters())


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text((REPO / "benchmarks" / "lessons.py").read_text())
    return path


def test_the_report_of_ddp_on_2_ranks_equals_a_direct_count(tmp_path, corpus):
    out = tmp_path / "out"
    cmd = [PYTHON, TOOL, "--strategies", "ddp", "--ranks", 2, "--steps", 2, "--out", out]
    cmd += ["--cache_dir", tmp_path / "cache"]
    proc = run([*cmd, "--", "--data", corpus, *TINY], timeout=300, cwd=tmp_path)
    params = gpt_parameter_tensors(len(set(corpus.read_text())))
    count = sum(p.numel() for p in params)
    trained = [p for p in params if p.requires_grad]  # not the head's frozen padding bias
    expected = {
        "params": count,
        "params_bytes": 4 * count,  # float32
        "grads_bytes": 4 * sum(p.numel() for p in trained),
        # AdamW: two moments and a float32 step each
        "optimizer_bytes": 2 * 4 * sum(p.numel() for p in trained) + 4 * len(trained),
    }
    report = json.loads((out / "memory.json").read_text())
    assert (report["ranks"], report["device"]) == (2, "cpu")
    ranks = report["results"]["ddp"]["ranks"]
    assert len(ranks) == 2
    for rank, memory in enumerate(ranks):
        assert {k: memory[k] for k in expected} == expected, rank
        assert memory["peak_kind"] == "max_rss" and memory["peak_bytes"] > 50 * 2**20  # torch alone
        # the printed table and the markdown file carry the measured numbers
        numbers = [f"{expected[k]:,}" for k in ("params_bytes", "grads_bytes", "optimizer_bytes")]
        row = f"| ddp | {rank} | " + " | ".join(numbers) + f" | {memory['peak_bytes'] / 2**20:.0f} | "
        assert row in (out / "memory.md").read_text() and row in proc.stdout, proc.stdout
    assert "1.00 / 1.00 / 1.00 | 1 / 1 / 1: every rank holds everything |" in proc.stdout
    assert (out / "memory.png").read_bytes().startswith(b"\x89PNG")


def test_a_strategy_that_fails_is_reported_with_its_error(tmp_path):
    out = tmp_path / "out"
    cmd = [PYTHON, TOOL, "--strategies", "ddp", "--ranks", 2, "--steps", 1, "--out", out]
    cmd += ["--", "--data", "missing.txt"]
    proc = run(cmd, timeout=300, cwd=tmp_path, check=False)
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "Traceback" not in proc.stdout
    row = "| ddp | - | - | - | - | - | failed: exit 1: train.py: error: --data missing.txt: no such file |"
    assert row in (out / "memory.md").read_text(), proc.stdout[-2000:]
    assert json.loads((out / "memory.json").read_text())["results"]["ddp"]["failed"].endswith("no such file")


def test_an_unknown_strategy_exits_2_and_writes_nothing(tmp_path):
    proc = run(
        [PYTHON, TOOL, "--strategies", "ddp", "nope", "--out", tmp_path / "out"], timeout=120, check=False
    )
    assert proc.returncode == 2
    assert re.search(
        r"--strategies: unknown \['nope'\]; train.py's --parallel choices: \[.*'ddp'", proc.stdout
    )
    assert not list(tmp_path.iterdir())


def test_sharded_parameters_count_their_local_shard_only(tmp_path):
    """FSDP2 on 2 ranks: each rank holds half of every tensor (all dimensions are even here)."""
    cmd = [*FORKRUN, "--nproc-per-node=2", PROGRAMS / "sharded_memory.py", EXAMPLES / "gpt"]
    proc = run(cmd, timeout=120, cwd=tmp_path, env=GPT_ON_PATH)
    reports = [json.loads(line) for line in re.findall(r"^MEMORY (.*)$", proc.stdout, re.M)]
    full = 4 * (8 * 16 + 16 + 16 * 8 + 8)
    assert len(reports) == 2
    for memory in reports:
        assert memory["params_bytes"] == memory["grads_bytes"] == full // 2
        assert memory["optimizer_bytes"] == full + 4 * 4  # two half moments, a whole scalar step each


def test_tied_weights_count_once_and_inner_optimizers_are_found():
    meter_module = import_gpt_module("observability.memory")
    embed, head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)
    head.weight = embed.weight
    model = torch.nn.Sequential(embed, head)

    class Wrapper(torch.optim.Optimizer):  # keeps its state in an inner optimizer, as ZeRO does
        def __init__(self, params):
            params = list(params)
            super().__init__(params, {})
            self.optim = torch.optim.SGD(params, lr=0.1, momentum=0.9)

        def step(self, closure=None):
            self.optim.step()

    optimizer = Wrapper(model.parameters())
    meter = meter_module.MemoryMeter(model, optimizer)
    model(torch.tensor([[1, 2]])).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    memory = meter.report(torch.device("cpu"))
    assert memory["params"] == 40
    assert memory["params_bytes"] == memory["grads_bytes"] == memory["optimizer_bytes"] == 160
