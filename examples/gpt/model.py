"""A decoder-only GPT: token and position embeddings, then pre-norm blocks of causal
self-attention and an MLP, then a final norm and an output layer that shares its
weight with the token embedding."""

import hashlib
import math
import re
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int = 128  # the longest context the model sees
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True  # in the linear layers and layer norms (--bias)
    activation: str = "gelu"  # the MLP's: gelu (exact), or gelu_tanh (GPT-2's, for its weights: hf.py)

    @property
    def padded_vocab(self):
        """The embedding's rows and the head's outputs: the vocabulary rounded up to a multiple of
        64, the matrix shapes GPUs multiply fastest (GPT-2's 50257 -> 50304). Below 4096 tokens it
        is kept as it is: there the padding would cost more than it saves (65 characters padded to
        128 nearly double the head's work; even to 72, the padding's bias costs 2% of a CPU step).
        The rows past the vocabulary are never read in, and the head's frozen bias (padding_bias)
        keeps them out of the loss and samples."""
        if self.vocab_size < 4096:
            return self.vocab_size
        return -(-self.vocab_size // 64) * 64


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.head_width, self.dropout = cfg.n_embd // cfg.n_head, cfg.dropout
        # the fused projection's outputs are laid out head by head, each head's q, k, v together: a
        # split of its rows into equal parts (tensor parallelism) hands every part whole heads
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.proj_dropout = nn.Dropout(cfg.dropout)
        # tensor parallel: which share of the heads this
        # process computes (parallel/tensor_parallel.py sets it)
        self.head_share = None
        self.kernels = None  # --attention's (choose_attention): None leaves torch its own choice

    def forward(self, x):
        batch, length, _ = x.shape
        # (batch, length, heads * 3 * head width) -> three tensors of (batch, heads, length, head
        # width); the head count comes from the tensor: a tensor-parallel process computes only its
        # share of the heads. Unbound, not permuted: backward stacks the three gradients straight
        # into the projection's layout, without a copy of the whole (1% of a CPU step)
        per_head = self.qkv(x).view(batch, length, -1, 3, self.head_width)
        q, k, v = (t.transpose(1, 2) for t in per_head.unbind(3))
        # is_causal: position t attends to positions <= t only, so later tokens never change
        # earlier outputs
        y = self.attend(q, k, v, self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(batch, length, -1)
        return self.proj_dropout(self.proj(y))

    def attend(self, q, k, v, dropout):
        """Causal attention. Under tensor parallelism the processes of one batch share one random
        stream (the dropout after each block must agree), so without care each share of the heads
        would draw the same attention masks: heads j and j + heads/N alike. Here every share draws
        from its own stream, seeded from the shared one (which so moves alike everywhere), as
        distinct heads do in one process. The kernel: torch's choice (its order, its switches such
        as torch.backends.cuda.enable_cudnn_sdp), or the one --attention names. On the CPU, bf16 and fp16
        inputs may run in float32 (attends_in_float32)."""
        if attends_in_float32(q):
            with torch.autocast("cpu", enabled=False):  # autocast would cast them back
                return self.attend(q.float(), k.float(), v.float(), dropout).to(q.dtype)
        with sdpa_kernel(self.kernels) if self.kernels else nullcontext():
            if not dropout or self.head_share is None:
                return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
            with own_stream(self.head_share, q.device):
                return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)


# bf16 attention on a CPU with AMX runs in bf16 from this length x head width squared: 1024 tokens at
# width 32, 256 at 64, where it overtakes float32 (benchmarks/cpu_attention.py). Without AMX its
# bf16 kernel took 3.3-6.1x float32's time at every shape measured (AVX2): there it always casts.
CPU_BF16_ATTENTION_FROM = 2**20
CPU_HAS_AMX = torch.cpu._is_amx_tile_supported()


def attends_in_float32(q):
    """Whether attention on these queries runs in float32, its inputs and output cast: on the CPU, in fp16
    always, in bf16 below CPU_BF16_ATTENTION_FROM and always without AMX, where torch's kernel takes longer
    than float32's with the casts (docs/performance.md: 2.9x at the cpu preset's 128 tokens of width 32, on
    a Xeon with AMX). Its softmax is in float32 either way."""
    if q.device.type != "cpu" or q.dtype == torch.float32:
        return False
    if q.dtype == torch.float16 or not CPU_HAS_AMX:
        return True
    return q.size(2) * q.size(3) ** 2 < CPU_BF16_ATTENTION_FROM


def cpu_emulates(dtype):
    """Whether this x86 CPU multiplies dtype in software, lacking the instructions torch's 16-bit
    matmuls need (its own test, mkldnn_check_low_precision, reads them too): bf16 without AMX,
    AVX-512 BF16 or AVX-NE-CONVERT; fp16 without AMX-FP16, AVX-512 FP16 or AVX-NE-CONVERT. Other
    CPUs are not judged. On an AVX2 EPYC a bf16 matmul took 32 times float32's, a step 10 times."""
    caps = torch.cpu.get_capabilities()
    if caps.get("architecture") != "x86_64" or caps.get("avx_ne_convert"):
        return False
    if dtype == torch.bfloat16:
        return not (CPU_HAS_AMX or caps.get("avx512_bf16"))
    return dtype == torch.float16 and not (caps.get("amx_fp16") or caps.get("avx512_fp16"))


# --attention: auto leaves the kernel to torch; each other choice allows that kernel alone (a call it
# cannot take fails: "No available kernel")
ATTENTION = {
    "auto": None,
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "flash": [SDPBackend.FLASH_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "math": [SDPBackend.MATH],
}


def choose_attention(model, choice):
    """Every attention of model runs the kernels --attention `choice` allows."""
    for module in model.modules():
        if isinstance(module, CausalSelfAttention):
            module.kernels = ATTENTION[choice]


def attention_kernel(cfg, device, dtype, dropout, choice="auto", heads=None, batch=1):
    """The kernel attend() runs in training, by name, found by running attention once on inputs of
    the training's shape (batch, this process's heads) and type, as attend() does: each fused
    kernel has a backward of its own, named after it (for example
    ScaledDotProductCudnnAttentionBackward0 -> cudnn_attention); math is made of ordinary
    operations. "... in float32" where attends_in_float32 casts the inputs."""
    shape = (batch, heads or cfg.n_head, cfg.block_size, cfg.n_embd // cfg.n_head)
    # its random numbers (and dropout's) from a copy of the
    # random state: training's streams stay as they were
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        q = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
        cast = attends_in_float32(q)
        x = q.float() if cast else q
        with sdpa_kernel(ATTENTION[choice]) if ATTENTION[choice] else nullcontext():
            y = F.scaled_dot_product_attention(x, x, x, dropout_p=dropout, is_causal=True)
    fused = re.fullmatch(r"ScaledDotProduct(\w+)Backward\d+", type(y.grad_fn).__name__)
    name = re.sub(r"(?<=[a-z])(?=[A-Z])", "_", fused.group(1)).lower() if fused else "math"
    return f"{name} in float32" if cast else name


@contextmanager
def own_stream(share, device):
    """A random stream of this share's own (of the heads, the positions or the pipeline's stages)
    for the code inside, seeded from the stream the processes of one batch share, which so moves
    alike everywhere."""
    seed = int(torch.randint(2**62, ()))
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed + share)
        yield


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"

    def forward(self, x):
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate=self.approximate)))


class LayerNorm(nn.LayerNorm):
    """A LayerNorm computed in float32 whatever its weights' type: FSDP gathers them in
    bf16 under --dtype bf16, where one process keeps them in float32; both then normalise
    alike, as autocast does on a GPU."""

    def forward(self, x):
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), bias, self.eps)


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln1 = LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)
        self.recompute = False  # activation checkpointing (ac.apply_ac)

    def forward(self, x):
        # grad mode read first: evaluation and sampling then never read recompute, so a compiled
        # block's graphs for them serve every block (parallel/apply.py), recomputed or not
        if torch.is_grad_enabled() and self.recompute:
            # keep the input only; backward recomputes the
            # rest, with the same random state (dropout)
            return checkpoint(self.residual, x, use_reentrant=False)
        return self.residual(x)

    def residual(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.padded_vocab, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)
        # by name, "0" to "n_layer - 1": a pipeline stage keeps some of them under their own names
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.ln_f = LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.head = nn.Linear(cfg.n_embd, cfg.padded_vocab, bias=cfg.padded_vocab > cfg.vocab_size)
        self.head.weight = self.tok_emb.weight  # one matrix reads tokens in and scores them out
        if self.head.bias is not None:  # frozen: 0 for the vocabulary, PADDING_SCORE for the padding
            self.head.bias.requires_grad_(False)
        # positions per chunk of the loss (head_loss); None under tp, whose head leaves the logits
        # split over the vocabulary (parallel/tensor_parallel.py): 1/tp of them per process, their loss
        # computed on that split
        self.loss_chunk = 1024
        # a pipeline's last stage sets it (parallel/pipeline_parallel.py): forward then stops at
        # the final norm, and the schedule's loss function applies the head
        # (head_loss), so its loss is chunked too
        self.stop_before_head = False
        # no initialisation here: the model is usually built on the meta device, and
        # each process then fills in its own part of every parameter
        # (parallel/apply.py materialise, with initial_value below)

    def init_weights(self, seed):
        """Every parameter as initial_value makes it:
        what a process holding the whole model does."""
        with torch.no_grad():
            for name, param in self.named_parameters():
                param.copy_(initial_value(name, param.shape, self.cfg, seed))

    def forward(self, idx, targets=None):
        """Logits (batch, length, vocab); with targets, (None, the mean cross-entropy over all
        positions): the loss is computed from the final norm's output (head_loss), never from whole
        logits. A pipeline stage's module maps what it receives to what it sends on (layers)."""
        x = self.layers(idx)
        if self.head is None or self.stop_before_head:
            return x
        if targets is None:
            return self.head(x)
        return None, self.head_loss(x, targets)

    def head_loss(self, x, targets):
        """The mean cross-entropy of the head's logits of
        x (the final norm's output) against targets."""
        if self.loss_chunk is None:
            return cross_entropy(self.head(x), targets)
        return chunked_cross_entropy(x, self.head.weight, self.head.bias, targets, self.loss_chunk)

    def layers(self, x):
        """Token ids through every part this module holds, in order: the whole model maps
        them to the final norm's output. A pipeline stage (parallel/pipeline_parallel.py) holds some
        blocks and sets the parts it lacks to None: it maps what the stage before it sends to
        what the next one receives."""
        if self.pos_emb is not None:  # the first stage (the last one keeps tok_emb only as the head)
            length = x.shape[1]
            if length > self.cfg.block_size:
                raise ValueError(f"sequence of {length} tokens, longer than block_size {self.cfg.block_size}")
            tokens, positions = self.tok_emb(x), self.pos_emb(torch.arange(length, device=x.device))
            # the residual stream in float32 in every layout, also where FSDP gathers bf16 weights
            x = self.dropout(tokens.float() + positions.float())
        for block in self.blocks.values():
            x = block(x)
        return x if self.ln_f is None else self.ln_f(x)

    @torch.no_grad()
    def generate(self, idx, new_tokens, **kwargs):
        return generate(self, idx, new_tokens, self.cfg.block_size, **kwargs)


@torch.no_grad()
def generate(logits_of, idx, new_tokens, block_size, *, temperature=0.8, top_k=None, generator=None):
    """Append new_tokens sampled one at a time from logits_of(context) (batch, length, vocab); the
    context is cut to the last block_size tokens."""
    for _ in range(new_tokens):
        logits = logits_of(idx[:, -block_size:])
        logits = logits[:, -1, :].float() / temperature
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
            logits[logits < kth] = -float("inf")
        probs = F.softmax(logits, dim=-1)
        # sampled on the CPU with a seeded generator, so the text is the same on every device
        nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(idx.device)
        idx = torch.cat([idx, nxt], dim=1)
    return idx


def initial_value(name, shape, cfg, seed):
    """Parameter `name`'s initial value, whole, on the CPU, from a generator seeded by (seed, name)
    alone: a process that holds a part of it takes that part, so every layout starts from the same
    weights as one process, and none builds more than one whole parameter at a time. As GPT-2:
    normal(0, 0.02) matrices and embeddings, the projections into the residual stream smaller by
    depth, zero biases, unit norms."""
    if name == "head.bias":
        return padding_bias(shape, cfg)
    if name.endswith("bias"):
        return torch.zeros(shape)
    if ".ln" in name or name.startswith("ln_"):
        return torch.ones(shape)
    key = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:7], "little")
    std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("proj.weight") else 0.02
    return torch.empty(shape).normal_(0.0, std, generator=torch.Generator().manual_seed(key))


# A padded row's score: its probability exp(-10000 - max) is 0 in float32, so the loss and
# the samples see the vocabulary only, and a padded row's gradient is 0. Finite, and
# within fp16's and bf16's range.
PADDING_SCORE = -1e4


def padding_bias(shape, cfg):
    """The head's bias: 0 for the vocabulary's outputs, PADDING_SCORE for the padding's."""
    return torch.where(torch.arange(shape[0]) < cfg.vocab_size, 0.0, PADDING_SCORE)


def init_buffers(model):
    """Buffers (a rotary table, a mask) have no values on the meta device, nor after to_empty:
    every module that holds some says how to fill them, in a method init_buffers(), called here
    once its storage exists. model.py's GPT has none."""
    missing = []
    for name, module in model.named_modules():
        own = [f"{name}.{b}".lstrip(".") for b, _ in module.named_buffers(recurse=False)]
        if own and hasattr(module, "init_buffers"):
            with torch.no_grad():
                module.init_buffers()
        else:
            missing += own
    if missing:
        raise TypeError(f"buffers {missing} cannot be filled: give their module an init_buffers() method")


IGNORE = -100  # a target that counts for nothing (padding), as F.cross_entropy's ignore_index


def cross_entropy(logits, targets):
    """The mean loss over the positions whose target is not IGNORE, in float32 whatever the
    autocast type."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE)


def chunked_cross_entropy(x, weight, bias, targets, chunk):
    """cross_entropy(F.linear(x, weight, bias), targets), `chunk` positions at a time: only one
    chunk's logits, and their float32 copy, exist at once."""
    x, targets = x.reshape(-1, x.size(-1)), targets.reshape(-1)
    return ChunkedCrossEntropy.apply(x, weight, bias, targets, chunk, torch.is_grad_enabled())


class ChunkedCrossEntropy(torch.autograd.Function):
    """The head and the loss, one chunk of positions at a time, as Liger-Kernel's fused linear
    cross-entropy: while a chunk's logits exist, forward also computes their gradient (softmax
    minus the target's one-hot, for the sum of the chunk's losses) and from it the gradients of x,
    the weight and a bias that trains; backward only scales them. No logits are kept for backward
    nor recomputed there. The gradient is the mean's (divided by the positions counted) before the
    matmuls, as whole logits' is: in fp16 it overflows no sooner than theirs."""

    @staticmethod
    def forward(ctx, x, weight, bias, targets, chunk, grad_enabled):
        # inside forward grad mode is always off: whether
        # gradients are wanted is read before (grad_enabled)
        wants = [grad_enabled and needed for needed in ctx.needs_input_grad[:3]]
        grad_x = torch.zeros_like(x) if wants[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if wants[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if wants[2] else None
        total = torch.zeros((), device=x.device)
        count = (targets != IGNORE).sum()  # on the device: nothing read back
        for start in range(0, len(targets), chunk):
            xs, ts = x[start : start + chunk], targets[start : start + chunk]
            counted = ts != IGNORE
            ts = ts.where(counted, 0)  # an ignored position's row: any index, its terms zeroed
            logits = F.linear(xs, weight, bias)  # bf16 under autocast, as the whole head's
            log_probs = F.log_softmax(logits, dim=-1, dtype=torch.float32)
            total -= (log_probs.gather(1, ts[:, None]).squeeze(1) * counted).sum()
            if not any(wants):
                continue
            # the gradient of the mean loss by the chunk's logits, in place of the log-probabilities
            grad = log_probs.exp_()
            grad[torch.arange(len(ts), device=ts.device), ts] -= 1
            grad *= counted[:, None] / count
            grad = grad.to(logits.dtype)  # the matmuls below in the head's type (autocast's bf16)
            if grad_x is not None:
                grad_x[start : start + chunk] = grad @ weight
            if grad_weight is not None:
                grad_weight += grad.T @ xs
            if grad_bias is not None:
                grad_bias += grad.sum(dim=0)
        # kept for backward in the inputs' types: FSDP's gathered bf16 head gets a bf16 gradient,
        # and no float32 copy of the whole head outlives the forward
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        ctx.save_for_backward(grad_x, grad_weight, grad_bias)
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        # the mean's gradients scaled by the loss's own gradient (a gradient scaler's factor), in
        # place: backward runs once. autograd casts each to its input's type
        grads = [None if g is None else g.mul_(grad_loss) for g in ctx.saved_tensors]
        return *grads, None, None, None


def parameter_count(model, non_embedding=True):
    """Parameters, without the position embedding by
    default (the token embedding is also the head)."""
    count = sum(p.numel() for p in model.parameters())
    return count - model.pos_emb.weight.numel() if non_embedding else count


def flops_per_token(model, llmc=False):
    """Training FLOPs per token, forward and backward: 6 per weight plus attention's scores and
    mixing, 12 * layers * width * context (heads * head width = width). llmc=True: llm.c's count
    (gpt2_estimate_mfu in train_gpt2.cu), 6 per trained parameter, the position embedding's too,
    and 6 * layers * width * context."""
    cfg = model.cfg
    if llmc:
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)  # not the padding bias
        return 6 * trained + 6 * cfg.n_layer * cfg.n_embd * cfg.block_size
    return 6 * parameter_count(model) + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


def optimizer_groups(model, weight_decay):
    """AdamW groups: weight decay on the matrices of linear
    layers; none on biases, norms and embeddings."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():  # by name: a pipeline stage may hold the head alone
        if not param.requires_grad:  # the head's padding bias
            continue
        embedding = name.split(".")[0] in ("tok_emb", "pos_emb", "head")  # the head is the token embedding
        (decay if param.dim() >= 2 and not embedding else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
