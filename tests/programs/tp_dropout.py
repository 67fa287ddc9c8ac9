"""Dropout under tp on 2 gloo processes: each share of the heads draws its own masks, as distinct heads do
in one process.

Started by tests/gpt/test_gpt_model_parallel.py."""

import os

import torch
import torch.distributed as dist
from model import GPT, GPTConfig
from parallel.tensor_parallel import apply_tp
from torch.distributed.device_mesh import init_device_mesh

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
# an odd vocabulary, not padded: the embedding and head split 3 and 2 rows, which tp must take too
model = GPT(GPTConfig(vocab_size=5, block_size=16, n_layer=1, n_head=4, n_embd=32, dropout=0.5))
model.init_weights(seed=0)
with torch.no_grad():
    model.pos_emb.weight.zero_()  # every position alike: attention is uniform and its values are equal
model.dropout.p = 0.0  # (the embeddings' dropout would make positions differ)
apply_tp(model, mesh)
seen = []  # the attention output of this rank's heads, before the projection
local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
model.blocks["0"].attn.proj.register_forward_pre_hook(lambda m, args: seen.append(local(args[0]).detach()))
idx = torch.zeros(1, 16, dtype=torch.long)
model.eval()
model(idx)
torch.manual_seed(1)  # the same stream on both ranks, as the trainer seeds the processes of one batch
model.train()
model(idx)
kept = (seen[1] / seen[0])[0].view(16, 2, -1)[:, :, 0]  # per position and local head: kept share of inputs
both = [torch.empty_like(kept) for _ in range(2)]
dist.all_gather(both, kept)
if dist.get_rank() == 0:
    print("RESULT", "alike" if torch.allclose(both[0], both[1]) else "distinct", flush=True)
dist.barrier()
os._exit(0)  # as train.py ends: DTensor still holds the group, whose threads could abort a normal shutdown
