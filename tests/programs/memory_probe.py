"""pp x FSDP and initialisation on 4 processes, without the trainer: what each process holds of the
model (argv[1] names the layout), and that the materialised weights equal one process's.

Started by tests/gpt/test_gpt_memory.py."""

import os
import sys
import weakref
from types import SimpleNamespace

import model as model_mod
import parallel
import torch
import torch.distributed as dist
from model import GPT, GPTConfig
from parallel import apply
from parallel.mesh import Layout

kind = sys.argv[1]
dist.init_process_group("gloo")
if kind == "pp":  # one block per stage, 4 micro-batches
    layout = Layout(pp=2, dp_shard=2)
    cfg = GPTConfig(vocab_size=8, block_size=16, n_layer=2, n_head=2, n_embd=16, dropout=0.5)
elif kind == "fsdp":  # two blocks, one micro-batch
    layout = Layout(dp_shard=4)
    cfg = GPTConfig(vocab_size=8, block_size=16, n_layer=2, n_head=2, n_embd=16)
else:  # FSDP over tp's shards: a matrix split twice along its rows (_StridedShard)
    layout = Layout(dp_shard=2, tp=2)
    cfg = GPTConfig(vocab_size=10, block_size=16, n_layer=2, n_head=2, n_embd=18)
args = SimpleNamespace(
    seed=0, compile=False, comm_hook=None, ac="none", ac_every=2, pp_schedule="1f1b", pp_microbatches=4
)
made, alive = [], []
initial_value = model_mod.initial_value


def spy(*args, **kwargs):  # how many whole values are still alive when the next is made
    alive.append(sum(ref() is not None for ref in made))
    value = initial_value(*args, **kwargs)
    made.append(weakref.ref(value))
    return value


apply.initial_value = spy
with torch.device("meta"):
    model = GPT(cfg)
run = parallel.parallelize(model, layout, args, torch.device("cpu"))
if kind in ("pp", "fsdp"):
    if model.dropout is not None:
        model.dropout.p = 0.0  # the first stage's embedding dropout would shift its stream
    masks, gathers = [], []
    for block in model.blocks.values():
        block.mlp.dropout.register_forward_hook(lambda m, i, out: masks.append((out == 0).float()))
    all_gather = dist.all_gather_single  # looked up by FSDP at each call

    def counting(*args, **kwargs):
        gathers.append(1)
        return all_gather(*args, **kwargs)

    dist.all_gather_single = counting
    torch.manual_seed(1)  # one stream on every process of the share, as the trainer seeds them
    x = torch.randint(8, (8, 16))
    run.step(x, x, lambda loss: loss.backward())  # the first step also infers the stages' shapes
    masks.clear()
    gathers.clear()
    run.step(x, x, lambda loss: loss.backward())
    count = torch.tensor([len(gathers)])
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    mine = torch.cat([m.flatten() for m in masks])
    every = [torch.empty_like(mine) for _ in range(4)]
    dist.all_gather(every, mine)
    # ranks 0 and 2: the first and the second stage of one data-parallel share
    result = ("alike" if every[0].equal(every[2]) else "distinct") + f" all-gathers {count.item()}"
    if kind == "fsdp":
        result = f"all-gathers {count.item()}"
else:
    ok = max(alive) == 0
    for name, p in model.named_parameters():
        whole = p.full_tensor() if hasattr(p, "full_tensor") else p
        ok &= whole.equal(initial_value(name, p.shape, cfg, 0))
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    result = ("equal" if flag.item() else "different") + f", at most {max(alive)} other whole value alive"
if dist.get_rank() == 0:
    print("RESULT", result, flush=True)
dist.barrier()
os._exit(0)  # as train.py ends: FSDP still holds the group, whose threads could abort a normal shutdown
