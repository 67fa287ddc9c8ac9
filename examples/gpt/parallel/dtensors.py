"""A tensor as this process holds it (local), whole, or the mesh dimensions it is split
along: the same calls for plain tensors and DTensors, wherever the layout put them."""

from torch.distributed.tensor import DTensor, Replicate


def local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def whole(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def sharded_dims(tensor):
    """The mesh dimensions a DTensor is split along (FSDP's dp_shard, tp's), by name."""
    if not isinstance(tensor, DTensor):
        return ()
    names = tensor.device_mesh.mesh_dim_names
    return tuple(n for n, p in zip(names, tensor.placements, strict=True) if not isinstance(p, Replicate))
