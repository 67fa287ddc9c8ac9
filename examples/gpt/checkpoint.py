"""Snapshots: written atomically by one process, read without running any code, checked against the run."""

import os
import pickle
from pathlib import Path


class SnapshotError(Exception):
    """A snapshot this run cannot resume from; it is left as it is."""


def save(path, state):
    """torch.save into a temporary file, fsync, then rename over path: a crash leaves the old snapshot."""
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load(path, expected):
    """The snapshot at path, after checking that its entries in `expected` (model shape, vocabulary) match.

    weights_only=True: only tensors and plain containers are unpickled, never objects that run code.
    """
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise SnapshotError(
            f"cannot resume from {path}: not a plain weights file (corrupt, or holding objects that would "
            "run code when loaded). It was left untouched; move it away or pass another --snapshot_path"
        ) from None
    except Exception as exc:
        first_line = (str(exc).strip() or "no detail").splitlines()[0]
        raise SnapshotError(f"cannot resume from {path}: {type(exc).__name__}: {first_line}") from None
    if not isinstance(state, dict) or "config" not in state:
        raise SnapshotError(f"cannot resume from {path}: it is not a snapshot of this trainer")
    differences = [
        f"{key} {state['config'].get(key)!r} (this run: {value!r})"
        for key, value in expected.items()
        if state["config"].get(key) != value
    ]
    if differences:
        raise SnapshotError(
            f"cannot resume from {path}: it was written by another configuration: {'; '.join(differences)}. "
            "It was left untouched; move it away or pass another --snapshot_path to start a new run"
        )
    return state
