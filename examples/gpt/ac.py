"""Activation checkpointing: which blocks keep only their input for the backward pass and recompute
the rest there (--ac). Applied to the model's blocks before any parallelism, so it composes with
every layout, and the FSDP or tensor-parallel block around it gathers or splits as before.

    none       every block keeps its activations (fastest, most memory)
    full       every block recomputes: per block, its input is kept (batch x context x width values)
    selective  every n-th block recomputes (--ac_every n, as torchtitan's per-layer selective mode):
               about 1/n of the activations saved
"""

MODES = ("none", "full", "selective")


def recomputed_blocks(n_layer, mode, every):
    """The indices of the blocks that recompute: every
    n-th counted from the first (n-1, 2n-1, ...)."""
    if mode == "none":
        return set()
    step = 1 if mode == "full" else every
    return {i for i in range(n_layer) if (i + 1) % step == 0}


def apply_ac(model, mode, every):
    """Mark the chosen blocks (by their index in the whole model, so a pipeline stage picks the
    blocks one process would): model.Block.forward then runs them under torch.utils.checkpoint."""
    chosen = recomputed_blocks(model.cfg.n_layer, mode, every)
    for name, block in model.blocks.items():
        block.recompute = int(name) in chosen
