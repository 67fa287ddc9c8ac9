"""Snapshots: written atomically by one process, read without running any code, checked against the run."""

import os
import pickle
import re
import shutil
import time
import warnings
from contextlib import contextmanager
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
    A directory is a sharded snapshot (load_sharded_header); None when it holds no complete one yet.
    """
    import torch

    if Path(path).is_dir():
        return load_sharded_header(path, expected)

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


# ---- sharded snapshots: a directory, each process writing and reading its own shards ---------------------
#   PATH/latest                    the name of the newest complete step directory, replaced atomically
#   PATH/step-00000060-<id>/       torch.distributed.checkpoint (DCP) files: model and optimizer, in shards
#   PATH/step-00000060-<id>/extra.pt  the rest (config, step, random states...) as in a single-file snapshot
POINTER = "latest"
STEP_DIR = re.compile(r"^step-\d{8}-[0-9a-f]+$")

# What DCP's .metadata pickle may name: its own record classes, torch.Size, dtypes, layouts and paths.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        import torch

        if (module, name) in _METADATA_CLASSES or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def _reader(step_dir):
    """DCP's file reader, with .metadata unpickled through an allowlist instead of plain pickle.load."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            folder = Path(step_dir).resolve()
            with open(folder / ".metadata", "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            # DCP joins these paths to the folder as they are: an absolute one, or one with "..", would
            # make it read any file on the machine. Refused before any data is read.
            for item in (getattr(metadata, "storage_data", None) or {}).values():
                where = getattr(item, "relative_path", None)
                if (
                    not isinstance(where, str)
                    or os.path.isabs(where)
                    or not ((folder / where).resolve().is_relative_to(folder))
                ):
                    raise pickle.UnpicklingError(f"a storage path, {where!r}, leaves the snapshot's folder")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(step_dir)


def _planner():
    """DCP's default load planner, with non-tensor entries read by torch.load(weights_only=True)."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            loaded = torch.load(value, weights_only=True)
            fqn = read_item.dest_index.fqn
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return SafePlanner()


@contextmanager
def _no_single_process_warning():
    """DCP warns when it runs without a process group; here one process (or export.py) is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*uninitialized")
        yield


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_sharded(path, model, optimizer, extra):
    """A collective: every process writes its shards of the model and optimizer (any parallel layout that
    get_state_dict understands) into a new step directory; then process 0 adds `extra` and points
    PATH/latest at it with one atomic rename, and removes older step directories. A crash at any moment
    leaves the previous snapshot complete and pointed at."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    distributed, path = dist.is_initialized(), Path(path)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    name = [f"step-{int(extra['step']):08d}-{time.time_ns():x}"]  # never the directory `latest` names
    if distributed:
        dist.broadcast_object_list(name, src=0)
    target = path / name[0]
    with _no_single_process_warning():
        dcp.save(
            {"model": model_state, "optimizer": optimizer_state},
            storage_writer=dcp.FileSystemWriter(target),
            no_dist=not distributed,
        )
    if not distributed or dist.get_rank() == 0:
        save(target / "extra.pt", extra)
        _fsync_dir(target)
        tmp = path / f"{POINTER}.tmp"
        with open(tmp, "w") as f:
            f.write(name[0] + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path / POINTER)
        _fsync_dir(path)
        for old in path.iterdir():
            if old.is_dir() and STEP_DIR.match(old.name) and old.name != name[0]:
                shutil.rmtree(old)
    if distributed:
        dist.barrier()


def _latest(path):
    """The step directory PATH/latest names, or None when no save has completed yet."""
    pointer = Path(path) / POINTER
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    if not STEP_DIR.match(name) or not (Path(path) / name).is_dir():
        raise SnapshotError(f"cannot resume from {path}: {pointer} names no step directory ({name[:80]!r})")
    return Path(path) / name


def load_sharded_header(path, expected):
    """The newest complete sharded snapshot in directory `path`, checked like load(): its extra.pt
    (config, step, random states) with "shards", its step directory, added; its .metadata is read
    through the allowlist here already. None if no save has completed yet."""
    step_dir = _latest(path)
    if step_dir is None:
        return None
    state = load(step_dir / "extra.pt", expected)
    try:
        _reader(step_dir).read_metadata()
    except pickle.UnpicklingError as exc:
        raise SnapshotError(
            f"cannot resume from {path}: {step_dir / '.metadata'} is not plain checkpoint metadata "
            f"({exc}). It was left untouched; move it away or pass another --snapshot_path"
        ) from None
    except Exception as exc:
        raise SnapshotError(f"cannot resume from {path}: {step_dir / '.metadata'}: {exc}") from None
    state["shards"] = str(step_dir)
    return state


def load_sharded(step_dir, model, optimizer):
    """A collective: every process reads the shards it holds (a different number of processes from the
    saving run is fine: DCP reshards), then they are set into the model and the optimizer."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    try:
        reader, planner = _reader(step_dir), _planner()
        with _no_single_process_warning():
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=not dist.is_initialized())
    except (Exception, dcp.CheckpointException) as exc:
        # DCP gathers every process's failure into one exception (not an Exception); name the first
        failures = getattr(exc, "failures", None)
        cause = next(iter(failures.values()))[0] if failures else exc
        first_line = (str(cause).strip() or "no detail").splitlines()[0]
        if isinstance(cause, pickle.UnpicklingError):
            first_line = "it holds objects that would run code when loaded"
        raise SnapshotError(
            f"cannot resume from {step_dir}: {type(cause).__name__}: {first_line}. "
            "It was left untouched; move it away or pass another --snapshot_path"
        ) from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
