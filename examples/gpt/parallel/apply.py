"""parallelize(): the functions of the other modules applied to a model built on the meta
device, in the order the layout needs, then each process's part given its initial values
(materialise)."""

import torch
from ac import apply_ac
from model import init_buffers, initial_value
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from parallel.data_parallel import apply_ddp, apply_fsdp
from parallel.dtensors import local
from parallel.mesh import build_mesh
from parallel.pipeline_parallel import Pipeline, split_stage
from parallel.runner import Parallel
from parallel.tensor_parallel import apply_tp


def apply_compile(model, mode="default"):
    """--compile: each block's forward compiled in place, as torchtitan compiles each block,
    after tp and before FSDP. fullgraph: a graph break is an error, never a block run eagerly.
    The blocks share their code, so one compiled graph serves them all. The forward, not the
    module (block.compile() would trace its hooks): FSDP's all-gathers, which dynamo never
    traces, run around the graph; and the parameters keep their names, so snapshots load
    across compiled and eager runs."""
    for block in model.blocks.values():
        block.forward = torch.compile(block.forward, fullgraph=True, mode=mode)


def parallelize(model, layout, args, device, param_dtype=None):
    """The meta-device model split over the layout, materialised: a Parallel (or Pipeline), or in a
    single process the plain model behind the same interface. Activation checkpointing (--ac) is
    set on the blocks first, whatever the layout."""
    apply_ac(model, args.ac, args.ac_every)
    if layout.world == 1:
        if args.compile:
            apply_compile(model, args.compile_mode)
        materialise(model, device, args.seed)
        return Parallel(model, model, layout, None)
    mesh = build_mesh(layout, device)
    if layout.pp > 1:
        split_stage(model, mesh)
    if layout.tp > 1:
        apply_tp(model, mesh)
    if args.compile:
        apply_compile(model, args.compile_mode)
    # replicas beside tp or pp are HSDP's (FSDP2 with dp_shard 1):
    # DDP takes no DTensors, nor a pipeline schedule's micro-batches
    sharded = layout.dp_shard > 1 or (layout.dp_replicate > 1 and (layout.tp > 1 or layout.pp > 1))
    if sharded:
        apply_fsdp(model, mesh, param_dtype, reshard_after_forward=layout.pp == 1)
    materialise(model, device, args.seed)
    if layout.pp > 1:
        return Pipeline(model, layout, mesh, args, device)
    runner = model
    if layout.dp_replicate > 1 and not sharded:
        runner = apply_ddp(runner, mesh, device, args.comm_hook)
    return Parallel(model, runner, layout, mesh)


def materialise(model, device, seed):
    """Storage for this process's parts (the model was built on the meta device), filled with
    their initial values: each parameter is made whole on the CPU, one at a time, cut there
    (local_part), and only this process's part is copied to the device; buffers as their
    modules fill them (init_buffers)."""
    model.to_empty(device=device)
    if model.head is not None and model.tok_emb is not None:
        model.head.weight = model.tok_emb.weight  # to_empty gives each module its own tensor
    init_buffers(model)
    cpu_meshes = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = initial_value(name, param.shape, model.cfg, seed)
            local(param).copy_(local_part(value, param, cpu_meshes))
            del value  # the next whole parameter is made once this one is gone


def local_part(value, param, cpu_meshes):
    """This process's part of the whole CPU tensor `value` of a (DTensor) parameter, cut on the
    CPU as distribute_tensor cuts it (which would first copy the whole tensor to the
    parameter's device): on a CPU mesh of the same ranks, without process groups, and
    src_data_rank=None, so nothing is sent."""
    if not isinstance(param, DTensor):
        return value
    mesh = param.device_mesh
    if id(mesh) not in cpu_meshes:
        names = mesh.mesh_dim_names
        cpu_meshes[id(mesh)] = DeviceMesh("cpu", mesh.mesh, mesh_dim_names=names, _init_backend=False)
    return distribute_tensor(value, cpu_meshes[id(mesh)], param.placements, src_data_rank=None).to_local()
