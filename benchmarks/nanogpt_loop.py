"""nanoGPT's training loop (karpathy/nanoGPT's train.py and model.py) as its README runs it on CPUs, written
anew here as the baseline of `benchmarks/gpt_throughput.py --nanogpt`.

    torchrun --standalone --nproc-per-node=2 benchmarks/nanogpt_loop.py --data DIR --max_iters 60

DIR holds nanoGPT's train.bin (uint16 token ids) and meta.pkl (its vocab_size), as its data/*/prepare.py
writes them; prepare(DIR) below writes Python's standard library there as its shakespeare_char does a text,
one id a character; examples/gpt/train.py reads the same folder. Kept from nanoGPT, with its defaults, its
shakespeare_char config's optimizer settings and its README's CPU settings (device cpu, compile off,
float32, no bias, dropout 0): the model (pre-norm blocks, one fused q/k/v projection,
scaled_dot_product_attention, GELU, the head tied to the token embedding, its initialisation), the loss over
whole logits, AdamW with weight decay on every matrix (single-tensor on a CPU, as nanoGPT builds it there),
each micro-batch read from random offsets of a fresh np.memmap of train.bin, gradient accumulation (the
whole batch split over the processes) with DDP's sync on the last micro-batch only, clipping at 1.0, the
cosine schedule after a linear warm-up, and on rank 0 one loss read back and one line per iteration:
"iter N: loss L, time T ms". The one change that CPU DDP needs: gloo, the CPU as every process's device,
DDP without device_ids. Left out, as the benchmark times training alone:
evaluation, checkpoints, the MFU estimate; and modules that do nothing here (dropout at 0, a CPU's disabled
GradScaler): microseconds an iteration of tens of milliseconds.
"""

import argparse
import math
import os
import pickle
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel


class LayerNorm(nn.Module):
    def __init__(self, width, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.c_attn = nn.Linear(args.n_embd, 3 * args.n_embd, bias=args.bias)
        self.c_proj = nn.Linear(args.n_embd, args.n_embd, bias=args.bias)
        self.n_head = args.n_head

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.c_attn(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(batch, length, width))


class Block(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.ln_1, self.ln_2 = LayerNorm(args.n_embd, args.bias), LayerNorm(args.n_embd, args.bias)
        self.attn = Attention(args)
        self.c_fc = nn.Linear(args.n_embd, 4 * args.n_embd, bias=args.bias)
        self.mlp_proj = nn.Linear(4 * args.n_embd, args.n_embd, bias=args.bias)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, args, vocab_size):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, args.n_embd)
        self.wpe = nn.Embedding(args.block_size, args.n_embd)
        self.h = nn.ModuleList(Block(args) for _ in range(args.n_layer))
        self.ln_f = LayerNorm(args.n_embd, args.bias)
        self.lm_head = nn.Linear(args.n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif param.dim() >= 2:  # the projections back into the residual stream start smaller
                std = 0.02 / math.sqrt(2 * args.n_layer) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(param, 0.0, std)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def prepare(folder, characters=3_000_000):
    """nanoGPT's character-level preparation of a text: the standard library's modules, in name order up to
    `characters`, as train.bin (the first 90%), val.bin and meta.pkl (vocab_size, itos, stoi)."""
    text = ""
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text += path.read_text(errors="replace")
        if len(text) >= characters:
            break
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ids[: int(0.9 * len(ids))].tofile(folder / "train.bin")
    ids[int(0.9 * len(ids)) :].tofile(folder / "val.bin")
    meta = {"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}
    (folder / "meta.pkl").write_bytes(pickle.dumps(meta))


def get_batch(data_dir, args):
    data = np.memmap(data_dir / "train.bin", dtype=np.uint16, mode="r")  # anew each call, as nanoGPT does
    starts = torch.randint(len(data) - args.block_size, (args.batch_size,))
    length = args.block_size
    x = torch.stack([torch.from_numpy(data[i : i + length].astype(np.int64)) for i in starts])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + length].astype(np.int64)) for i in starts])
    return x, y


def learning_rate(step, args):
    if step < args.warmup_iters:
        return args.learning_rate * (step + 1) / (args.warmup_iters + 1)
    ratio = min(1.0, (step - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters))
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.learning_rate - args.min_lr)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="a folder of train.bin and meta.pkl")
    parser.add_argument("--max_iters", type=int, default=60)
    parser.add_argument("--batch_size", type=int, default=16, help="sequences a micro-batch")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2, help="split over processes")
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=128)
    parser.add_argument("--bias", action="store_true", help="nanoGPT's default: none")
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--min_lr", type=float, default=1e-4)
    parser.add_argument("--beta2", type=float, default=0.99)
    parser.add_argument("--warmup_iters", type=int, default=100)
    args = parser.parse_args()
    ddp = "RANK" in os.environ
    rank, world = 0, 1
    if ddp:
        init_process_group(backend="gloo")
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if args.gradient_accumulation_steps % world:
            parser.error("--gradient_accumulation_steps must split evenly over the processes")
        args.gradient_accumulation_steps //= world
    torch.manual_seed(1337 + rank)
    with open(args.data / "meta.pkl", "rb") as f:
        vocab_size = pickle.load(f)["vocab_size"]
    model = GPT(args, vocab_size)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate, betas=(0.9, args.beta2))
    if ddp:
        model = DistributedDataParallel(model)
    tokens_per_iter = args.gradient_accumulation_steps * world * args.batch_size * args.block_size
    if rank == 0:
        print(f"tokens per iteration will be: {tokens_per_iter:,}", flush=True)
    x, y = get_batch(args.data, args)
    start = time.time()
    for step in range(args.max_iters):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        for micro in range(args.gradient_accumulation_steps):
            if ddp:
                model.require_backward_grad_sync = micro == args.gradient_accumulation_steps - 1
            _, loss = model(x, y)
            loss = loss / args.gradient_accumulation_steps
            x, y = get_batch(args.data, args)  # the next batch while nothing waits on it
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        now = time.time()
        elapsed, start = now - start, now
        if rank == 0:
            loss_value = loss.item() * args.gradient_accumulation_steps
            print(f"iter {step}: loss {loss_value:.4f}, time {elapsed * 1000:.2f}ms", flush=True)
    if ddp:
        destroy_process_group()


if __name__ == "__main__":
    main()
