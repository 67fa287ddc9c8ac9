"""Memory per rank of the GPT trainer (examples/gpt/observability/memory.py) and the report of
benchmarks/gpt_memory.py.

Budget: under 60 s. Measured on 2 shared cores: 49 s at load average 2 to 3, 110 s at 4 to 5 (each torchrun
start imports torch three times).
"""

import json
import re

import pytest
import torch
from conftest import EXAMPLES, GPT_ON_PATH, PROGRAMS, PYTHON, REPO, TORCHRUN, import_gpt_module, run

TOOL = REPO / "benchmarks" / "gpt_memory.py"
TINY = ["--n_layer", 1, "--n_head", 2, "--n_embd", 32, "--block_size", 16, "--batch_size", 4]


def gpt_parameter_tensors(vocab_size):
    """The GPT of TINY's shape, built here: its parameters, the tied embedding and head weight once."""
    model = import_gpt_module("model")
    cfg = model.GPTConfig(vocab_size=vocab_size, n_layer=1, n_head=2, n_embd=32, block_size=16)
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
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node=2", PROGRAMS / "sharded_memory.py", EXAMPLES / "gpt"]
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
