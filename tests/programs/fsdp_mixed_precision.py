"""FSDP2's mixed precision as data_parallel.py sets it, on 2 gloo processes without the trainer: parameters
gathered in bf16 (or not), gradients reduced in float32, the shards kept in float32.

Started by tests/gpt/test_gpt_sharding.py."""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from model import GPT, GPTConfig
from parallel.data_parallel import apply_fsdp
from torch.distributed.device_mesh import init_device_mesh


def probe(rank, port, bf16):
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + port, rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=16))
    model.init_weights(seed=0)
    seen = []  # a block's weight dtype while it runs, and what the gradient reduce-scatter carries
    block = next(iter(model.blocks.values()))
    linear = next(m for m in block.modules() if isinstance(m, torch.nn.Linear))
    linear.register_forward_pre_hook(lambda module, args: seen.append(module.weight.dtype))
    reduce_scatter = dist.reduce_scatter_single  # looked up by FSDP at each call

    def recording(*args, **kwargs):
        seen.append(kwargs["input"].dtype)
        return reduce_scatter(*args, **kwargs)

    dist.reduce_scatter_single = recording
    apply_fsdp(model, mesh, torch.bfloat16 if bf16 else None)
    x = torch.randint(16, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        model(x, x)[1].backward()
    shard = next(iter(block.parameters()))
    if rank == 0:
        print("RESULT", seen[0], seen[-1], shard.dtype, shard.grad.dtype, flush=True)
    dist.barrier()
    os._exit(0)  # as train.py ends: FSDP still holds the group, whose threads could abort a normal shutdown


if __name__ == "__main__":
    mp.spawn(probe, args=(sys.argv[2], sys.argv[3] == "bf16"), nprocs=2)
