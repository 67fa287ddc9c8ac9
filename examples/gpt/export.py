"""Write a snapshot directory (any layout's) as one file: the single-file snapshot that
torch.load(weights_only=True) reads and that --init_from imports into any layout.

    python examples/gpt/export.py gpt_snapshot gpt_snapshot.pt

It runs in one process and reads every part, so the whole model and optimizer state must fit in memory.
"""

import argparse
import os
import sys
from dataclasses import fields

import checkpoint
import torch
from model import GPT, GPTConfig, optimizer_groups


def load_whole(snapshot_dir):
    """(the snapshot's other entries, the model, its AdamW) read from every part of a snapshot."""
    state = checkpoint.load(snapshot_dir, {})
    if state is None:
        raise checkpoint.SnapshotError(f"{snapshot_dir} holds no complete snapshot")
    shape = {f.name for f in fields(GPTConfig)}  # the config also holds checks: vocabulary digest, layout
    with torch.device("meta"):
        model = GPT(GPTConfig(**{key: value for key, value in state["config"].items() if key in shape}))
    model.to_empty(device="cpu")
    model.head.weight = model.tok_emb.weight  # to_empty gives each module its own tensor
    # the groups as in training; their settings (lr, betas, weight decay) come from the snapshot
    optimizer = torch.optim.AdamW(optimizer_groups(model, 0.0))
    checkpoint.load_shards(state.pop("shards"), model, optimizer)
    return state, model, optimizer


def single_file_state(snapshot_dir):
    """What the single file holds: the snapshot's entries, the model's and the optimizer's whole state."""
    state, model, optimizer = load_whole(snapshot_dir)
    model_state, optimizer_state = checkpoint.whole_state(model, optimizer)
    return {**state, "model": model_state, "optimizer": optimizer_state}


def main():
    p = argparse.ArgumentParser(description="Export a GPT snapshot directory to one plain file.")
    p.add_argument("snapshot", help="the snapshot directory (--snapshot_path of a run)")
    p.add_argument("out", help="the file to write; an existing one is replaced only with --force")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    args = p.parse_args()
    if not os.path.isdir(args.snapshot):
        p.error(f"{args.snapshot} is not a directory: a snapshot is one")
    if os.path.isdir(args.out) or (os.path.exists(args.out) and not args.force):
        p.error(f"{args.out} exists: pass --force to replace it, or another OUT")
    try:
        state = single_file_state(args.snapshot)
    except checkpoint.SnapshotError as exc:
        sys.exit(f"error: {exc}")
    checkpoint.save_file(args.out, state)
    print(f"wrote {args.out}: step {state['step']}")


if __name__ == "__main__":
    main()
