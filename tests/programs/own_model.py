"""GPT-J's block: attention and the MLP side by side on one norm, and a squared-ReLU MLP; the rest is the
interface docs/gpt.md lists (blocks, tok_emb, pos_emb, ln_f, head, qkv/proj/fc names for tp).

Started by tests/gpt/test_gpt_own_model.py."""

import runpy
import sys

import model
import torch
import torch.nn.functional as F
import trainer
from torch import nn


class SquaredReLU(model.MLP):
    def forward(self, x):
        return self.dropout(self.proj(F.relu(self.fc(x)).square()))


class ParallelBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = model.CausalSelfAttention(cfg)
        self.mlp = SquaredReLU(cfg)
        # a buffer (as a rotary table or a mask is): built on the meta device, it holds no value there
        self.register_buffer("one_half", torch.full((cfg.n_embd,), 0.5), persistent=False)

    def init_buffers(self):  # what the trainer calls once the buffer has storage
        self.one_half.fill_(0.5)

    def forward(self, x):
        h = self.ln1(x)
        return x * (2 * self.one_half) + self.attn(h) + self.mlp(h)


class OwnModel(model.GPT):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.blocks = nn.ModuleDict({str(i): ParallelBlock(cfg) for i in range(cfg.n_layer)})


trainer.GPT = OwnModel
finish = trainer.Trainer.finish


def finish_and_show_buffers(self, meter):
    values = sorted({float(v) for b in self.raw.buffers() for v in b.flatten()})
    print(f"rank {self.rank}: buffer values {values}", flush=True)
    return finish(self, meter)


trainer.Trainer.finish = finish_and_show_buffers
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
