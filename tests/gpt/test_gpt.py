"""The GPT trainer (examples/gpt): causal model, DDP equal to one process, accumulation, metrics, exact
resume (also after a SIGKILL under torchrun, SIGTERM or Ctrl-C), hangs named, snapshots it cannot use; and the
helpers the other GPT test files import (train, saved, the corpus cache fixture). Data sources are
test_gpt_data.py's, refusals test_gpt_checks.py's, the benchmark test_gpt_throughput.py's. Tiny model
shapes: the file took 298 s on 2 cores at load average 1 to 4 before those moved out."""

import argparse
import itertools
import json
import pickle
import random
import re
import shutil
import signal
import time

import psutil
import pytest
import torch
import torch.nn.functional as F
from fault import once_more_after_torch_race  # demos/fault.py: a worker killed under torchrun
from gpt_helpers import (
    TINY,
    TRAIN,
    VAL_RE,
    RunsCode,
    assert_close,
    assert_identical,
    assert_stopped_and_resumed_ends_bit_identical,
    files,
    max_diff,
    run,
    saved,
    train,
)
from helpers import (
    GPT_ON_PATH,
    GPU_ENV,
    GPUS,
    PROGRAMS,
    PYTHON,
    REPO,
    TORCHRUN,
    import_gpt_module,
    start_torchrun_agent,
)


# ---- the model ---------------------------------------------------------------------------------------
def test_changing_a_token_never_changes_the_outputs_at_earlier_positions():
    model_mod = import_gpt_module("model")
    torch.manual_seed(0)
    cfg = model_mod.GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32)
    model = model_mod.GPT(cfg).eval()
    model.init_weights(seed=0)
    idx = torch.randint(50, (3, 16))
    base = model(idx)
    for t in (0, 5, 15):
        changed = idx.clone()
        changed[:, t] = (changed[:, t] + 1) % 50
        out = model(changed)
        assert out[:, :t].equal(base[:, :t]), f"a token at {t} changed earlier outputs"
        assert not torch.allclose(out[:, t], base[:, t]), "the changed position itself must change"


def test_the_padded_vocabulary_is_invisible_to_loss_grads_samples():
    """The padded vocabulary is invisible to the loss the gradients and the samples.

    4100 tokens padded to 4160 rows: the loss equals the cross-entropy over the 4100 real outputs, the
    padded rows get no gradient and are never sampled. The rule: a multiple of 64 from 4096 tokens (GPT-2's
    50257 -> 50304); a smaller vocabulary as it is (65 characters: 65 rows, not 128). Mutations: the
    head's bias left at zero (the padding scored like any token): the loss differs; every vocabulary
    rounded to 64: fails."""
    model_mod = import_gpt_module("model")
    cfg = model_mod.GPTConfig(vocab_size=4100, block_size=16, n_layer=2, n_head=2, n_embd=32)
    padded = {n: model_mod.GPTConfig(vocab_size=n).padded_vocab for n in (65, 4095, 4096, 4100, 50257)}
    assert padded == {65: 65, 4095: 4095, 4096: 4096, 4100: 4160, 50257: 50304}, padded
    model = model_mod.GPT(cfg)
    model.init_weights(seed=0)
    assert not model.head.bias.requires_grad
    idx = torch.randint(4100, (3, 16), generator=torch.Generator().manual_seed(0))
    logits = model(idx[:, :-1])
    _, loss = model(idx[:, :-1], idx[:, 1:])
    real = torch.nn.functional.cross_entropy(logits[..., :4100].reshape(-1, 4100), idx[:, 1:].reshape(-1))
    assert abs(loss.item() - real.item()) < 1e-5, (loss.item(), real.item())
    loss.backward()
    assert model.tok_emb.weight.grad[4100:].abs().max().item() == 0.0
    out = model.generate(idx[:, :1], 200, temperature=3.0, generator=torch.Generator().manual_seed(1))
    assert out.max().item() < 4100


def test_the_attention_kernel_is_torchs_unless_asked_and_named_at_start_up(tmp_path, cache):
    """--attention auto (the default) leaves the kernel to torch, its order and its switches; another
    choice allows that kernel alone; the start-up line names the kernel by running attention on the
    training's shape. On the CPU torch runs its own flash attention (math with dropout, which that
    kernel does not take), and math once `torch.backends.cuda.enable_flash_sdp(False)` says so.
    Mutations: attend() wrapping every call in a list that puts flash first (as it once did, cuDNN first
    on GPUs) -> flash after the switch said no; choose_attention not called -> --attention math runs
    flash; the probe's choice left out -> the line says flash for --attention math."""
    proc = train(tmp_path, cache, "--max_steps", 1, "--sample_chars", 0)
    assert "1 process(es) on cpu, float32, attention flash_attention_for_cpu |" in proc.stdout, proc.stdout
    model_mod, config = import_gpt_module("model"), import_gpt_module("config")
    assert config.parse_args(["--attention", "math", "--model", "cpu"])[1].attention == "math"
    assert set(model_mod.ATTENTION) == set(
        config.Config.__dataclass_fields__["attention"].metadata["kwargs"]["choices"]
    )
    cfg = model_mod.GPTConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=32)
    cpu = torch.device("cpu")
    assert model_mod.attention_kernel(cfg, cpu, torch.float32, 0.1) == "math"
    assert model_mod.attention_kernel(cfg, cpu, torch.float32, 0.0, "math", 1, 4) == "math"
    model = model_mod.GPT(cfg)
    q = torch.randn(1, 2, 16, 16, requires_grad=True)

    def ran():  # a fused kernel's backward is its own
        return type(model.blocks["0"].attn.attend(q, q, q, 0.0).grad_fn).__name__

    assert ran() == "ScaledDotProductFlashAttentionForCpuBackward0", ran()
    torch.backends.cuda.enable_flash_sdp(False)  # torch's switch, which auto leaves in charge
    try:
        assert not ran().startswith("ScaledDotProduct"), ran()
    finally:
        torch.backends.cuda.enable_flash_sdp(True)
    model_mod.choose_attention(model, "math")
    assert not ran().startswith("ScaledDotProduct"), ran()
    model_mod.choose_attention(model, "flash")
    assert ran() == "ScaledDotProductFlashAttentionForCpuBackward0", ran()


def test_cpu_attention_under_autocast_runs_in_float32_where_that_is_faster(monkeypatch):
    """On the CPU under autocast, attention computes in float32 (its inputs cast, its output cast back to
    the autocast type) in fp16 always and in bf16 below CPU_BF16_ATTENTION_FROM (length x head width
    squared) or without AMX, where torch's bf16 kernel is slower (benchmarks/cpu_attention.py); at and
    above it with AMX, in bf16; float32 inputs run as they are. Both CPUs are run here, AMX set either
    way. The dtype is read from what the kernel saved for backward. The cast's output agrees with bf16's
    own within bf16's precision, and its gradients flow back in bf16. The start-up line's kernel name
    (attention_kernel) says "in float32" where the cast runs. Only on the CPU; dropout passes through.
    Mutations: the cast left out -> bf16 at 16 tokens; autocast left on around it -> bf16
    again (autocast casts the inputs back); the test on fp16 left out -> fp16 above the threshold; the
    probe without the cast -> no "in float32"; length and width swapped in the rule -> 2048 x 16 not
    cast; dropout not passed on -> the outputs equal; the CPU test left out -> a meta tensor cast; AMX
    not read -> bf16 at 2048 x 64 without it."""
    model_mod = import_gpt_module("model")
    monkeypatch.setattr(model_mod, "CPU_HAS_AMX", True)
    cfg = model_mod.GPTConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=32)
    attn = model_mod.GPT(cfg).blocks["0"].attn
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(1, 2, 16, 16, generator=gen)

    def run(dtype):  # the output, its gradient, and the type the kernel computed in
        q = base.to(dtype, copy=True).requires_grad_()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            y = attn.attend(q, q, q, 0.0)
        node = y.grad_fn
        while not hasattr(node, "_saved_query"):  # back through the cast to the kernel's node
            node = node.next_functions[0][0]
        computed = node._saved_query.dtype
        y.float().square().sum().backward()
        return y, q.grad, computed

    assert 16 * 16**2 < model_mod.CPU_BF16_ATTENTION_FROM
    for dtype in (torch.bfloat16, torch.float16):
        y, grad, computed = run(dtype)
        assert (y.dtype, grad.dtype, computed) == (dtype, dtype, torch.float32), (dtype, computed)
    y = run(torch.float32)[0]  # no cast: the kernel's own node is the output's
    assert type(y.grad_fn).__name__ == "ScaledDotProductFlashAttentionForCpuBackward0", y.grad_fn
    # the rule reads length x width squared (at 2048 x 16 below it, not at 16 x 2048), on the CPU only
    bf16 = torch.bfloat16
    assert model_mod.attends_in_float32(torch.empty(0, 0, 2048, 16, dtype=bf16))
    assert not model_mod.attends_in_float32(torch.empty(0, 0, 1024, 32, dtype=bf16))
    assert not model_mod.attends_in_float32(torch.empty(0, 0, 16, 16, dtype=torch.float16, device="meta"))
    with monkeypatch.context() as without:
        without.setattr(model_mod, "CPU_HAS_AMX", False)
        assert model_mod.attends_in_float32(torch.empty(0, 0, 2048, 64, dtype=bf16))
    with torch.no_grad(), torch.autocast("cpu", dtype=bf16):  # dropout reaches the cast's kernel
        q = base.to(bf16)
        assert not torch.equal(attn.attend(q, q, q, 0.5), attn.attend(q, q, q, 0.0))
    cpu = torch.device("cpu")  # the start-up line's name: the kernel, and the cast where there is one
    assert model_mod.attention_kernel(cfg, cpu, torch.bfloat16, 0.0) == "flash_attention_for_cpu in float32"
    assert model_mod.attention_kernel(cfg, cpu, torch.float32, 0.0) == "flash_attention_for_cpu"
    cast, cast_grad, _ = run(torch.bfloat16)
    monkeypatch.setattr(model_mod, "CPU_BF16_ATTENTION_FROM", 16 * 16**2)
    own, own_grad, computed = run(torch.bfloat16)
    assert computed == torch.bfloat16
    torch.testing.assert_close(cast.float(), own.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(cast_grad.float(), own_grad.float(), atol=5e-2, rtol=2e-2)
    assert run(torch.float16)[2] == torch.float32


def test_a_cpu_without_16_bit_hardware_is_said_to_emulate_it(monkeypatch):
    """cpu_emulates, which the start-up line reads (test_gpt_compile.py checks the line), over every answer
    of the instructions it reads (torch.cpu.get_capabilities) on x86: bf16 in hardware with AMX, AVX-512
    BF16 or AVX-NE-CONVERT, fp16 with AMX-FP16, AVX-512 FP16 or AVX-NE-CONVERT; float32 always; a CPU of
    another architecture is not judged. Mutations: AVX-512 BF16 not read; fp16 read from AVX-512 alone
    (Skylake to Zen 5 lack FP16); AVX-NE-CONVERT not read; float32 said emulated; ARM judged: each fails."""
    model_mod = import_gpt_module("model")
    flags = ["amx_tile", "avx512_bf16", "amx_fp16", "avx512_fp16", "avx_ne_convert"]
    for values in itertools.product([False, True], repeat=len(flags)):
        caps = {"architecture": "x86_64", "avx512_f": True, **dict(zip(flags, values, strict=True))}
        monkeypatch.setattr(model_mod, "CPU_HAS_AMX", caps["amx_tile"])
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda caps=caps: caps)
        bf16 = caps["amx_tile"] or caps["avx512_bf16"] or caps["avx_ne_convert"]
        fp16 = caps["amx_fp16"] or caps["avx512_fp16"] or caps["avx_ne_convert"]
        assert model_mod.cpu_emulates(torch.bfloat16) == (not bf16), caps
        assert model_mod.cpu_emulates(torch.float16) == (not fp16), caps
        assert not model_mod.cpu_emulates(torch.float32), caps
    monkeypatch.setattr(model_mod, "CPU_HAS_AMX", False)
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"architecture": "aarch64"})
    assert not model_mod.cpu_emulates(torch.bfloat16) and not model_mod.cpu_emulates(torch.float16)


def head_gradients(model_mod, x, weight, targets, chunk, scale=1.0):
    """The loss and the gradients of x and the head's weight, through the chunked loss (chunk) or the
    whole logits (None), the loss scaled by `scale` before backward as a gradient scaler does."""
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    if chunk is None:
        loss = model_mod.cross_entropy(F.linear(x, weight), targets)
    else:
        loss = model_mod.chunked_cross_entropy(x, weight, None, targets, chunk)
    (loss * scale).backward()
    return loss, x.grad, weight.grad


def test_the_chunked_loss_ignores_padding_and_overflows_no_sooner_than_whole_logits():
    """Targets of -100 (padding, F.cross_entropy's ignore_index) count for nothing in the chunked loss as
    in the whole logits' (and tp's F.cross_entropy): the loss and the gradients within 1e-6, chunks of 7
    and one of all. In fp16, 1024 positions of one target with a large first feature (80): at each loss
    scale where the whole logits' gradients stay finite, the chunked loss's do too (the mean's gradient
    before the matmuls). Mutations: the ignored positions counted -> the loss differs; the gradient summed
    over the chunk and divided in backward (as before) -> non-finite at every scale."""
    model_mod = import_gpt_module("model")
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(45, 32, generator=gen), torch.randn(50, 32, generator=gen) * 0.1
    targets = torch.randint(50, (45,), generator=gen)
    targets[::3] = -100
    whole = head_gradients(model_mod, x, weight, targets, None)
    for chunk in (7, 1024):
        for mine, theirs in zip(head_gradients(model_mod, x, weight, targets, chunk), whole, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
    x = torch.randn(1024, 64, generator=gen).half()
    x[:, 0] = 80
    weight, targets = (torch.randn(96, 64, generator=gen) * 0.02).half(), torch.zeros(1024, dtype=torch.long)
    finite = []
    for scale in (1.0, 2.0**8, 2.0**16):
        ok = [all(g.isfinite().all() for g in head_gradients(model_mod, x, weight, targets, c, scale)[1:])
              for c in (None, 1024)]  # fmt: skip
        finite.append(ok)
        assert ok[1] or not ok[0], (scale, ok)
    assert any(whole_ok for whole_ok, _ in finite), finite  # the case tells them apart


def loss_and_gradients(model_mod, chunk, dtype=torch.float32):
    """The loss of a small model with a padded vocabulary (4100 tokens, 4160 rows: the head's frozen
    padding bias) and every parameter's gradient: in chunks of `chunk` positions (model.head_loss), or with
    None as before, the whole logits through model.cross_entropy."""
    cfg = model_mod.GPTConfig(vocab_size=4100, block_size=16, n_layer=2, n_head=2, n_embd=32)
    model = model_mod.GPT(cfg)
    model.init_weights(seed=0)
    idx = torch.randint(4100, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        if chunk is None:
            loss = model_mod.cross_entropy(model(idx[:, :-1]), idx[:, 1:])
        else:
            model.loss_chunk = chunk
            logits, loss = model(idx[:, :-1], idx[:, 1:])
            assert logits is None  # no whole logits made
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


def test_the_loss_in_chunks_equals_the_whole_logits_loss():
    """The loss in chunks equals the whole logits loss and its gradients.

    model.head_loss, 45 positions in chunks of 7 (the last one short), 16 and 1024 (one chunk): the
    loss and every parameter's gradient (the tied embedding and head, the frozen padding bias in the head)
    within 1e-5 of the whole logits' in float32 (6e-8 measured); under bf16 autocast no further from the
    float32 loss than the whole logits' bf16 is (2.5 times its distance at most; 1.5 measured). Mutations:
    the target's one-hot left out of the chunk's gradient, or the chunk's weight gradient not added up:
    the gradients differ and this fails."""
    model_mod = import_gpt_module("model")
    loss, grads = loss_and_gradients(model_mod, None)
    assert all(g is not None for g in grads.values())
    for chunk in (7, 16, 1024):
        chunked_loss, chunked = loss_and_gradients(model_mod, chunk)
        assert abs(chunked_loss - loss) < 1e-5, (chunk, chunked_loss, loss)
        for name, grad in grads.items():
            assert (chunked[name] - grad).abs().max().item() < 1e-5, (chunk, name)
    bf16_loss, bf16 = loss_and_gradients(model_mod, None, torch.bfloat16)
    chunked_loss, chunked = loss_and_gradients(model_mod, 7, torch.bfloat16)
    assert abs(chunked_loss - loss) <= 2.5 * abs(bf16_loss - loss) + 1e-6, (chunked_loss, bf16_loss, loss)
    for name, grad in grads.items():
        assert (chunked[name] - grad).norm() <= 2.5 * (bf16[name] - grad).norm() + 1e-6, name


def test_the_chunked_loss_trains_a_bias_and_skips_grads_in_no_grad():
    """The chunked loss trains a bias and computes no gradients without grad mode.

    model.chunked_cross_entropy against F.cross_entropy(F.linear(...)) with a bias that trains (a model
    of your own may have one): the same loss and gradients of x, weight and bias; under no_grad (evaluation)
    the same loss. With the weight and bias in bf16 (as FSDP2 gathers them under --dtype bf16), what it
    keeps for backward is in their type: no float32 copy of the head outlives the forward
    (benchmarks/loss_memory.py measures the memory). Mutations: the bias's gradient not added up: x.grad is
    right, bias.grad is 0, this fails; the gradients kept in float32 -> fails."""
    model_mod = import_gpt_module("model")
    gen = torch.Generator().manual_seed(0)
    x, weight, bias = (torch.randn(shape, generator=gen) for shape in [(2, 9, 8), (20, 8), (20,)])
    targets = torch.randint(20, (2, 9), generator=gen)
    results = []
    for chunked in (False, True):
        leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
        if chunked:
            loss = model_mod.chunked_cross_entropy(*leaves, targets, 4)
        else:
            loss = model_mod.cross_entropy(torch.nn.functional.linear(*leaves), targets)
        loss.backward()
        results.append((loss.detach(), *(t.grad for t in leaves)))
    for whole, chunks in zip(*results, strict=True):
        assert (whole - chunks).abs().max().item() < 1e-6
    with torch.no_grad():
        assert (model_mod.chunked_cross_entropy(x, weight, bias, targets, 4) - results[0][0]).abs() < 1e-6
    kept = []
    leaves = [x.requires_grad_(), weight.bfloat16().requires_grad_(), bias.bfloat16().requires_grad_()]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model_mod.chunked_cross_entropy(*leaves, targets, 4).backward()
    assert [(t.dtype, t.shape) for t in kept][1:] == [
        (torch.bfloat16, weight.shape),
        (torch.bfloat16, bias.shape),
    ]
    assert (
        leaves[1].grad.dtype == torch.bfloat16 and (leaves[1].grad.float() - results[0][2]).abs().max() < 0.05
    )


# ---- DDP, accumulation, metrics -----------------------------------------------------------------------
# --grad_clip 0: a clipped step hides a gradient off by a constant factor from AdamW, and so from the tests
RUN = ["--max_steps", 60, "--save_every", 10, "--metrics_path", "m.jsonl", "--grad_clip", 0]


@pytest.fixture(scope="module")
def ddp2(tmp_path_factory, cache):
    cwd = tmp_path_factory.mktemp("ddp2")
    proc = train(cwd, cache, *RUN, "--batch_size", 8, nproc=2)
    return cwd, proc.stdout


@pytest.fixture(scope="module")
def single(tmp_path_factory, cache):
    cwd = tmp_path_factory.mktemp("single")
    proc = train(cwd, cache, *RUN, "--batch_size", 16)
    return cwd, proc.stdout


def test_ddp_on_2_ranks_equals_one_process_with_the_same_global_batch(ddp2, single):
    ddp, one = saved(ddp2[0]), saved(single[0])
    diff = max_diff(ddp["model"], one["model"])
    print(f"DDP on 2 vs one process, 60 steps: max parameter difference {diff:.3g}")
    assert_close(ddp, one)
    assert "replicas identical: 2 copies" in ddp2[1], ddp2[1][-2000:]


@pytest.fixture(scope="module")
def accum(tmp_path_factory, cache):
    cwd = tmp_path_factory.mktemp("accum")
    train(cwd, cache, *RUN, "--batch_size", 8, "--grad_accum", 2)
    return cwd


def test_gradient_accumulation_equals_the_larger_batch(accum, single, ddp2):
    accum = saved(accum)
    assert_close(accum, saved(single[0]))
    # (g1 + g2) / 2 from DDP and g1 / 2 + g2 / 2 from accumulation are the same floats
    assert_identical(accum["model"], saved(ddp2[0])["model"])


def test_the_gradient_norm_of_step_1_is_the_plain_models_own(tmp_path, cache):
    """The gradient's scale against a reference outside the trainer: a factor applied in every run (one
    process included) passes every "equals one process" test, not this one. Step 1's norm as logged
    (before clipping; 2 micro-batches of 8) is that of the plain model's mean loss on the step's 16
    sequences, computed here with autograd from the same initial values."""
    args = ["--max_steps", 1, "--batch_size", 8, "--grad_accum", 2, "--log_every", 1, "--sample_chars", 0]
    train(tmp_path, cache, *args, "--metrics_path", "m.jsonl")
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    (logged,) = [r["grad_norm"] for r in records if "grad_norm" in r]
    config, data, model_mod, apply, train_state = map(
        import_gpt_module, ("config", "data", "model", "parallel.apply", "snapshots.train_state")
    )
    _, a = config.parse_args([str(arg) for arg in [*TINY, "--batch_size", 16, "--cache_dir", cache]])
    corpus = data.load_corpus(a.data, a.cache_dir, a.timeout, a.tokenizer, a.vocab_size)
    with torch.device("meta"):
        model = model_mod.GPT(train_state.model_config(a, corpus.vocab_size))
    apply.materialise(model, torch.device("cpu"), a.seed)
    offsets = data.step_offsets(a.seed, 0, 16, len(corpus.train), a.block_size)
    model(*data.gather(corpus.train, offsets, a.block_size))[1].backward()
    norm = torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]).norm().item()
    print(f"step 1's gradient norm: logged {logged:.6g}, the plain model's {norm:.6g}")
    assert logged == pytest.approx(norm, rel=1e-4)


def test_loss_falls_well_below_the_unigram_entropy_of_the_default_corpus(tmp_path, cache):
    proc = train(tmp_path, cache, "--max_steps", 100, "--eval_every", 50, "--batch_size", 16, "--lr", 5e-3)
    unigram = float(re.search(r"unigram entropy of the training text: ([0-9.]+)", proc.stdout).group(1))
    assert 2.5 < unigram < 4.5, unigram  # Python source: a few dozen frequent characters
    val = {int(s): float(v) for s, v in VAL_RE.findall(proc.stdout)}
    assert val[50] > val[100] and val[100] < unigram - 0.25, (unigram, val)


def test_metrics_file_holds_one_record_per_log_line_and_evaluation(ddp2):
    records = [json.loads(line) for line in (ddp2[0] / "m.jsonl").read_text().splitlines()]
    logs = [r for r in records if "loss" in r]
    assert [r["step"] for r in logs] == list(range(5, 61, 5))
    for r in logs:
        assert r["tokens_per_s"] > 0 and r["loss"] > 0 and r["world_size"] == 2
        assert "mfu" not in r  # no known peak on a CPU
    assert [r["step"] for r in records if "val_loss" in r] == [30, 60]
    assert "sample:" in ddp2[1]


def test_a_16_bit_comm_hook_keeps_replicas_identical_and_close_to_float32(tmp_path, cache, ddp2):
    proc = train(tmp_path, cache, *RUN, "--batch_size", 8, "--comm_hook", "bf16", nproc=2)
    assert "replicas identical: 2 copies" in proc.stdout, proc.stdout[-2000:]
    hooked = saved(tmp_path)["model"]
    plain = saved(ddp2[0])["model"]
    # gradients rounded to 8 significant bits on the wire: the run differs from float32 DDP, a little
    assert 0 < max_diff(hooked, plain) < 2e-2


@pytest.mark.gpu
def test_on_gpus_it_trains_in_bf16_and_reports_mfu(tmp_path, cache):
    args = ["--max_steps", 20, "--batch_size", 8, "--metrics_path", "m.jsonl", "--peak_tflops", 100]
    proc = train(tmp_path, cache, *args, nproc=min(2, GPUS), env=GPU_ENV)
    assert "on cuda, bfloat16" in proc.stdout or "on cuda, float16" in proc.stdout, proc.stdout[-2000:]
    logs = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert all(0 < r["mfu"] < 1 for r in logs if "loss" in r)
    [*_, last] = [r for r in logs if "val_loss" in r]  # the end's evaluation; the memory record follows it
    assert last["val_loss"] < logs[0]["loss"]


# ---- resume -----------------------------------------------------------------------------------------
def test_a_stopped_and_resumed_run_ends_bit_identical(tmp_path, cache):
    # dropout on: the random streams must continue exactly too; the cosine ends at step 30 in both runs
    args = ["--batch_size", 8, "--dropout", 0.1, "--decay_steps", 30, "--save_every", 7]
    assert_stopped_and_resumed_ends_bit_identical(tmp_path, cache, args, 15, 30)


STALLED = [*TORCHRUN, "--standalone", "--nproc-per-node=2", PROGRAMS / "stall.py", TRAIN]


def test_a_stalled_process_fails_the_run_within_dist_timeout(tmp_path, cache):
    cmd = [*STALLED, "--cache_dir", cache, *TINY, "--max_steps", 5, "--dist_timeout", 5]
    start = time.monotonic()
    proc = run(cmd, timeout=300, check=False, cwd=tmp_path, env=GPT_ON_PATH)
    seconds = time.monotonic() - start
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "error: process 0 waited more than --dist_timeout 5 s for the others" in proc.stdout, proc.stdout
    assert seconds < 120, seconds  # torch's own default would wait 30 minutes (gloo)
    # every process dumped (process 1 from the watcher thread, asleep in its main one): the report says who
    assert "every process wrote its stack to gpt_snapshot/hang: make why-hung RUN=gpt_snapshot" in proc.stdout
    report = run([PYTHON, REPO / "tools" / "why_hung.py", tmp_path / "gpt_snapshot"], timeout=120).stdout
    # rank 0's first collective after the stall: the first step's (trainer.py), whichever torch enters
    verdict = r"verdict: rank 1 is outside any collective, at \S*stall\.py:\d+ \(stalled\), while rank 0"
    assert re.search(verdict + " waits", report), report


def test_a_connection_a_peer_closed_is_reported_with_every_stack(tmp_path, cache):
    """A paused node: the first process to time out closes its connections, and the other's collective
    fails `Connection closed by peer`; that one must still dump and ask the others (a Docker test's report
    once lacked its stack), and say what it lost."""
    cmd = [*STALLED, "--cache_dir", cache, *TINY, "--max_steps", 5, "--dist_timeout", 60]
    env = {**GPT_ON_PATH, "STALL_LOSES": "1"}  # process 0's collective fails: the peer closed it
    proc = run(cmd, timeout=300, check=False, cwd=tmp_path, env=env)
    assert proc.returncode != 0, proc.stdout[-2000:]
    said = "error: process 0 lost its connection to another process, which gave up first or died"
    assert said in proc.stdout, proc.stdout[-3000:]
    assert "every process wrote its stack to gpt_snapshot/hang: make why-hung" in proc.stdout
    report = run([PYTHON, REPO / "tools" / "why_hung.py", tmp_path / "gpt_snapshot"], timeout=120).stdout
    assert re.search(r"rank 1 .*stall\.py:\d+", report), report  # asleep, asked by process 0
    assert re.search(r"rank 0 \(.*\): failed in ", report), report  # not a timeout of its own


@pytest.mark.parametrize(
    "error",
    [
        "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [172.18.0.3]:39085",  # seen in Docker
        "Application timeout caused pair closure",  # seen in Docker, on the process that did not time out
        "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:21932: Connection reset by peer",
        "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 15000ms for recv operation to complete",
    ],
)
def test_gloos_ways_of_losing_a_collective_each_dump_and_are_named(error, monkeypatch, tmp_path, capsys):
    """Gloo's ways of losing a collective to a hang each dump and are named."""
    failure = import_gpt_module("failures.failure")
    monkeypatch.setattr(failure.hang, "dump", lambda *args: [])  # what it would return: nobody silent
    args = argparse.Namespace(snapshot_path=str(tmp_path), dist_timeout=15.0)
    with pytest.raises(SystemExit) as exit_:
        failure.timed_out(args, 1, 4, RuntimeError(error))
    said = capsys.readouterr().err
    assert exit_.value.code == 1
    lost = "timed out" not in error.lower()
    assert ("lost its connection to another process" in said) == lost, said
    assert f"every process wrote its stack to {tmp_path}/hang" in said
    with pytest.raises(RuntimeError, match="CUDA out of memory"):  # anything else is raised as it came
        failure.timed_out(args, 1, 4, RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))


def test_a_killed_worker_is_restarted_and_the_run_ends_identical(tmp_path, cache, ddp2):
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node=2", "--max-restarts=1", TRAIN, "--cache_dir", cache]
    cmd += [*TINY, *RUN, "--batch_size", 8]

    def attempt():
        shutil.rmtree(tmp_path / "gpt_snapshot", ignore_errors=True)
        (tmp_path / "m.jsonl").unlink(missing_ok=True)
        agent = start_torchrun_agent(cmd, tmp_path)
        try:
            deadline = time.monotonic() + 300
            metrics = tmp_path / "m.jsonl"
            while not (metrics.exists() and '"step": 15' in metrics.read_text()):  # past the snapshot at 10
                assert agent.poll() is None, "training ended before the kill"
                assert time.monotonic() < deadline, "no step 15 within 300 s"
                time.sleep(0.02)
            workers = [p for p in psutil.Process(agent.pid).children() if str(TRAIN) in p.cmdline()]
            assert len(workers) == 2
            workers[-1].send_signal(signal.SIGKILL)
            out, _ = agent.communicate(timeout=600)
        finally:
            agent.kill()
        return agent.returncode, out

    code, out = once_more_after_torch_race(attempt)
    assert code == 0, out[-4000:]
    assert re.search(r"resuming from gpt_snapshot at step (1\d|20) \(step-", out), out[-4000:]
    resumed, uninterrupted = saved(tmp_path), saved(ddp2[0])
    assert resumed["step"] == 60
    assert_identical(uninterrupted["model"], resumed["model"])
    for name, state in uninterrupted["optimizer"]["state"].items():
        assert_identical(state, resumed["optimizer"]["state"][name])


# torchrun forwards SIGTERM (Slurm's scancel or --signal, a Kubernetes eviction) and SIGINT (Ctrl-C in its
# terminal, which reaches torchrun alone: its workers run in sessions of their own) to its workers
PREEMPTED = [*TINY, "--max_steps", 60, "--save_every", 1000, "--batch_size", 8, "--dropout", 0.1]
PREEMPTED += ["--log_every", 1, "--sample_chars", 0, "--metrics_path", "m.jsonl"]
STOPPED_RE = re.compile(
    r"^stopped by (SIGTERM|Ctrl-C) before step (\d+), saved in gpt_snapshot: the same command resumes$", re.M
)


def stop_when_training(cmd, cwd, signum, delay):
    """Start cmd, send signum once its first step is logged and `delay` seconds more have passed: (the exit
    status, the output, the seconds from the signal to the exit)."""
    agent = start_torchrun_agent(cmd, cwd, env={"OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 300
        while not (cwd / "m.jsonl").exists():
            assert agent.poll() is None and time.monotonic() < deadline, "no step within 300 s"
            time.sleep(0.01)
        time.sleep(delay)
        agent.send_signal(signum)
        start = time.monotonic()
        out, _ = agent.communicate(timeout=60)
        return agent.returncode, out, time.monotonic() - start
    finally:
        agent.kill()


def test_sigterm_or_ctrl_c_saves_and_the_resumed_run_is_bit_identical(tmp_path, cache):
    """SIGTERM or Ctrl-C saves the step under way and the resumed run ends bit identical.

    SIGTERM, then Ctrl-C, each at a random moment of a run on 2 processes (of one step, which holds its
    checks, a log line and an evaluation); mutations: the trainer's save on a stop request removed, or
    SIGINT left to Python's KeyboardInterrupt: both fail."""
    (tmp_path / "full").mkdir()
    train(tmp_path / "full", cache, *PREEMPTED, nproc=2)
    full = saved(tmp_path / "full")
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node=2", TRAIN, "--cache_dir", cache, *PREEMPTED]
    rng = random.Random(29)
    for trial in range(2):  # a random moment in each: within a step, its checks, a log line, an evaluation
        cwd = tmp_path / f"trial{trial}"
        cwd.mkdir()
        signum = (signal.SIGTERM, signal.SIGINT)[trial % 2]
        _, out, seconds = stop_when_training(cmd, cwd, signum, rng.uniform(0, 0.5))
        stopped = STOPPED_RE.search(out)
        assert stopped and stopped[1] == preempt_name(signum), out[-3000:]
        assert "KeyboardInterrupt" not in out, out[-3000:]  # (torchrun's own traceback names the signal)
        step = int(stopped[2]) - 1
        print(f"trial {trial}: {stopped[1]} at step {step}, saved and exited in {seconds:.2f} s")
        assert saved(cwd)["step"] == step, out[-3000:]
        proc = train(cwd, cache, *PREEMPTED, nproc=2)
        assert f"resuming from gpt_snapshot at step {step} (step-" in proc.stdout, proc.stdout[-2000:]
        resumed = saved(cwd)
        assert_identical(full["model"], resumed["model"])
        for name, state in full["optimizer"]["state"].items():
            assert_identical(state, resumed["optimizer"]["state"][name])


def test_ctrl_c_in_one_process_saves_and_ends_without_a_traceback(tmp_path, cache):
    """Ctrl-C in one process saves and ends in two lines without a traceback.

    python train.py alone: Ctrl-C says at once that it saves, then where it saved; exit status 0, no
    KeyboardInterrupt. Mutation: SIGINT left to Python -> a traceback and no snapshot: fails."""
    cmd = [PYTHON, TRAIN, "--cache_dir", cache, *PREEMPTED]
    code, out, _ = stop_when_training(cmd, tmp_path, signal.SIGINT, 0.2)
    assert code == 0 and "Traceback" not in out, out[-3000:]
    stopped = STOPPED_RE.search(out)
    assert stopped and stopped[1] == "Ctrl-C", out[-3000:]
    assert "Ctrl-C: saving at the next log step" in out, out[-3000:]
    assert saved(tmp_path)["step"] == int(stopped[2]) - 1


def preempt_name(signum):
    return import_gpt_module("failures.preempt").NAMES[signum]


@pytest.mark.parametrize("kind", ["other_config", "code"])
def test_a_snapshot_it_cannot_use_is_refused_and_left_untouched(tmp_path, cache, ddp2, kind):
    path = tmp_path / "gpt_snapshot.pt"  # a single file, imported with --init_from
    if kind == "code":
        path.write_bytes(pickle.dumps({"config": RunsCode()}))
        message = "not a plain weights file"
    else:
        import_gpt_module("snapshots.checkpoint").save_file(path, saved(ddp2[0]))
        message = "another configuration: n_layer 2 (this run: 3)"
    before = path.read_bytes()
    # torch.load's own default made unsafe: only the trainer's weights_only=True stands in the way
    env = {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
    args = ["--max_steps", 5, "--n_layer", 3, "--metrics_path", "m", "--init_from", path.name]
    proc = train(tmp_path, cache, *args, check=False, env=env)
    assert proc.returncode != 0
    assert message in proc.stdout and "left untouched" in proc.stdout, proc.stdout[-2000:]
    assert "Traceback" not in proc.stdout
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt_snapshot.pt"]  # no pwned, no metrics


def test_under_torchrun_another_shapes_snapshot_is_said_once(tmp_path, cache, ddp2):
    """Under torchrun a snapshot of another shape is said once in torchrun's summary.

    Every process finds the snapshot unusable: none prints it; torchrun's closing summary says it, once,
    last, as the error of local rank 0 (its error file), and the snapshot is left as it was."""
    shutil.copytree(ddp2[0] / "gpt_snapshot", tmp_path / "gpt_snapshot")
    before = files(tmp_path)
    proc = train(
        tmp_path, cache, *RUN, "--batch_size", 8, "--n_layer", 3, nproc=2, torchrun=True, check=False
    )
    assert proc.returncode != 0
    assert proc.stdout.count("another configuration: n_layer 2 (this run: 3)") == 1, proc.stdout[-3000:]
    summary = [line for line in proc.stdout.splitlines() if line.strip()]
    assert summary[-1].startswith("=====")
    assert summary[-2].startswith("  failures.failure.Failed: error: cannot resume"), proc.stdout[-3000:]
    assert "exitcode  : 1" in proc.stdout, proc.stdout[-3000:]
    assert files(tmp_path) == before


def test_raising_max_steps_on_resume_keeps_the_cosine_and_says_so(tmp_path, cache):
    """Raising --max_steps on resume keeps the cosine and says what changed."""
    train(tmp_path, cache, "--max_steps", 20, "--save_every", 20, "--weight_decay", 0.1)
    proc = train(tmp_path, cache, "--max_steps", 30, "--metrics_path", "m.jsonl", "--weight_decay", 0.0)
    assert "note: changed since the snapshot: max_steps 20 -> 30, weight_decay 0.1 -> 0" in proc.stdout
    assert "The cosine ends at step 20" in proc.stdout, proc.stdout[-2000:]
    lrs = logged_lrs(tmp_path / "m.jsonl")
    assert lrs and all(lr == pytest.approx(1e-4) for lr in lrs), lrs  # min_lr, no jump back up
    # --decay_steps given: the cosine is reshaped to end there, as asked
    (tmp_path / "m.jsonl").unlink()
    train(tmp_path, cache, "--max_steps", 40, "--decay_steps", 60, "--metrics_path", "m.jsonl")
    lrs = logged_lrs(tmp_path / "m.jsonl")
    assert lrs and min(lrs) > 1e-4, lrs


def logged_lrs(metrics):
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [record["lr"] for record in records if "lr" in record]
