"""Snapshots: one path for every layout. A snapshot is a directory that every process writes its
parts into with torch.distributed.checkpoint (DCP), through get_state_dict/set_state_dict, so any
layout and any number of processes resumes any other's; a crash at any moment leaves the previous
one complete. Nothing is read that would run code, or that lies outside the snapshot's folder.

    PATH/latest                         the name of the newest complete step directory, replaced atomically
    PATH/step-00000060-<id>/.metadata   DCP's index of the parts
    PATH/step-00000060-<id>/*.distcp    the model's and the optimizer's tensors, as each process held them
    PATH/step-00000060-<id>/extra.pt    the rest: config, vocabulary, step, random states... (leader)

A single file (export.py writes one from a snapshot) holds the same, whole:
torch.load(weights_only=True) reads it, and --init_from imports it into any layout (import_file).
"""

import dataclasses
import enum
import os
import pickle
import re
import shutil
import time
import warnings
import zipfile
from contextlib import contextmanager
from pathlib import Path


class SnapshotError(Exception):
    """A snapshot this run cannot resume from; it is left as it is."""


def atomic_write(path, write):
    """write(file) into a temporary file beside path, fsync, then rename over path: a
    reader, or a crash at any moment, sees the old file or all of the new one. The
    package's one way to write a file."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_file(path, state):
    """torch.save, atomically (a crash leaves the old file)."""
    import torch

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: torch.save(state, f))


def load_file(path, expected):
    """The single-file snapshot at path, after checking that its entries in `expected` (model
    shape, vocabulary) match. weights_only=True: only tensors and plain containers are unpickled,
    never objects that run code; mmap: its tensors stay on disk until used (only the leader uses
    them: import_file)."""
    import torch

    try:
        if not zipfile.is_zipfile(path):  # torch.save's format is a zip archive; a bare pickle is not
            raise pickle.UnpicklingError("not a zip archive")
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        raise SnapshotError(
            f"cannot resume from {path}: not a plain weights file (corrupt, or holding objects that would "
            "run code when loaded). It was left untouched; move it away or pass another file"
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


# ---- snapshot directories
# --------------------------------------------------------------------------------
POINTER = "latest"
STEP_DIR = re.compile(r"^step-\d{8}-[0-9a-f]+$")

# What DCP's .metadata pickle may name, by rule rather than by name: the data records (dataclasses
# and enums) of DCP's metadata and filesystem modules, torch.Size, dtypes, the function pickle
# rebuilds a torch.layout with, paths and OrderedDict. Only these modules are ever looked in;
# anything else is refused unread.
METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
LOOKED_IN = {*METADATA_MODULES, "torch", "torch.serialization", "pathlib", "collections"}


def allowed_in_metadata(module, found):
    import copyreg
    from collections import OrderedDict
    from pathlib import PosixPath, PurePosixPath, PureWindowsPath, WindowsPath

    import torch

    if module in METADATA_MODULES:
        return isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum))
    rebuild_layout = copyreg.dispatch_table[torch.layout](torch.strided)[0]
    plain = (torch.Size, rebuild_layout, OrderedDict, PosixPath, PurePosixPath, PureWindowsPath, WindowsPath)
    return isinstance(found, torch.dtype) or any(found is item for item in plain)


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        try:
            found = super().find_class(module, name) if module in LOOKED_IN else None
        except AttributeError:
            found = None
        if found is None or not allowed_in_metadata(module, found):
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")
        return found


def inside(folder, name, what):
    """folder/name, refused when it is absolute or leads
    out of folder, by ../ or by symbolic links."""
    root = os.path.realpath(folder)
    target = os.path.realpath(os.path.join(root, name))
    if not name or os.path.isabs(name) or target == root or os.path.commonpath([root, target]) != root:
        raise SnapshotError(
            f"cannot resume from {folder}: {what}, {name!r}, leaves the snapshot's folder; nothing was read. "
            "It was left untouched; move it away or pass another --snapshot_path"
        )
    return Path(folder) / name


def read_metadata(step_dir):
    """DCP's index of a step directory, unpickled through the allowlist; every file it
    names must lie inside step_dir (DCP would join an absolute or ../ path to the folder
    and open whatever it names)."""
    with open(inside(step_dir, ".metadata", "its index"), "rb") as f:
        metadata = MetadataUnpickler(f).load()
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        inside(step_dir, str(getattr(info, "relative_path", "")), "a storage path in its .metadata")
    return metadata


def reader(step_dir):
    """DCP's file reader, reading the index through read_metadata instead of plain pickle.load."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = read_metadata(self.path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(step_dir)


def planner():
    """DCP's default load planner over a flat state dict, non-tensor entries read by
    torch.load(weights_only=True) instead of torch.load(weights_only=False)."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    return SafePlanner(flatten_state_dict=False)


@contextmanager
def no_single_process_warning():
    """DCP warns when it runs without a process group;
    here one process (or export.py) is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*uninitialized")
        yield


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def flat_state(model, optimizer):
    """This process's parts of the model's and the optimizer's state, one flat dict keyed by
    parameter names ("model.<name>", "optimizer.state.<name>.exp_avg",
    "optimizer.param_groups.<name>.lr"), as get_state_dict gives them (DTensors for parts of split
    tensors): names, not positions, so that any layout finds its parts. An optimizer without state
    yet gets it (zeros) first, to be loaded into."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    return {f"model.{k}": v for k, v in model_state.items()} | {
        f"optimizer.{k}": v for k, v in optimizer_state.items()
    }


def set_flat_state(model, optimizer, state):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    parts = {"model": {}, "optimizer": {}}
    for key, value in state.items():
        part, name = key.split(".", 1)
        parts[part][name] = value
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    set_state_dict(model, optimizer, model_state_dict=parts["model"], optim_state_dict=parts["optimizer"],
                   options=options)  # fmt: skip


def save(path, model, optimizer, extra, leader=0, keep=1):
    """A collective: every process writes its parts of the model and the optimizer into a new step
    directory; then the process of rank `leader` adds `extra`, points PATH/latest at it with one
    atomic rename and removes step directories older than the `keep` newest. A crash at any moment
    leaves the previous snapshot complete and pointed at."""
    import torch.distributed as dist

    distributed = dist.is_initialized()
    name = [step_name(extra)]
    if distributed:
        dist.broadcast_object_list(name, src=leader)
    write(path, name[0], flat_state(model, optimizer), extra, distributed, leader, keep)
    if distributed:
        dist.barrier()


def step_name(extra):
    return f"step-{int(extra['step']):08d}-{time.time_ns():x}"  # never the directory `latest` names


def write(path, name, state, extra, distributed, leader=0, keep=1):
    """DCP writes `state` (flat: parameter names as keys) into PATH/name, every process its parts;
    then the leader (or the only process) commits it: extra.pt, fsync, the pointer renamed, step
    directories older than the `keep` newest removed."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    path = Path(path)
    target = path / name
    with no_single_process_warning():
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(target),
            planner=DefaultSavePlanner(flatten_state_dict=False),
            no_dist=not distributed,
        )
    if distributed and dist.get_rank() != leader:
        return
    save_file(target / "extra.pt", extra)
    fsync_dir(target)
    atomic_write(path / POINTER, lambda f: f.write(f"{name}\n".encode()))
    fsync_dir(path)
    # the keep - 1 newest others that were completed
    # (extra.pt is written last) stay beside this one
    others = [d for d in path.iterdir() if STEP_DIR.match(d.name) and d.is_dir() and not d.is_symlink()]
    complete = sorted(d for d in others if d.name != name and (d / "extra.pt").is_file())
    for old in set(others) - {target, *complete[max(0, len(complete) - keep + 1) :]}:
        shutil.rmtree(old)


def latest(path):
    """The step directory PATH/latest names, or None when no save has completed yet."""
    pointer = Path(path) / POINTER
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    if not STEP_DIR.match(name) or not (Path(path) / name).is_dir():
        raise SnapshotError(f"cannot resume from {path}: {pointer} names no step directory ({name[:80]!r})")
    return inside(path, name, "its step directory")


def load(path, expected):
    """The newest complete snapshot in directory `path`, checked before any process group forms:
    its extra.pt (config, step, random states), checked like a single file, with "shards" (its step
    directory) added; its .metadata is read through the allowlist and the path check here already.
    None if no save has completed yet."""
    step_dir = latest(path)
    if step_dir is None:
        return None
    state = load_file(inside(step_dir, "extra.pt", "its extra state"), expected)
    try:
        read_metadata(step_dir)
    except pickle.UnpicklingError as exc:
        raise SnapshotError(
            f"cannot resume from {path}: {step_dir / '.metadata'} holds more than checkpoint metadata "
            f"({exc}). It was left untouched; move it away or pass another --snapshot_path"
        ) from None
    except SnapshotError:
        raise
    except Exception as exc:
        raise SnapshotError(f"cannot resume from {path}: {step_dir / '.metadata'}: {exc}") from None
    state["shards"] = str(step_dir)
    return state


def load_shards(step_dir, model, optimizer):
    """A collective: every process reads the parts it holds, whatever layout wrote them (DCP
    reshards), and sets them into the model and the optimizer."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    state = flat_state(model, optimizer)
    try:
        with no_single_process_warning():
            dcp.load(
                state, storage_reader=reader(step_dir), planner=planner(), no_dist=not dist.is_initialized()
            )
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
    set_flat_state(model, optimizer, state)


def import_file(path, state, leader=0):
    """A collective: a single-file snapshot (its whole model and optimizer, as export.py writes
    them) made the first snapshot in directory PATH, by the process of rank `leader` alone; its
    step directory, which every process then reads its parts from like any other snapshot's
    (load_shards). The file's tensors go to disk as they are: no model is built for them."""
    import torch.distributed as dist

    distributed = dist.is_initialized()
    name = [None]
    if not distributed or dist.get_rank() == leader:
        extra = {key: value for key, value in state.items() if key not in ("model", "optimizer")}
        name[0] = step_name(extra)
        write(path, name[0], flat_whole(state), extra, distributed=False)
    if distributed:
        dist.broadcast_object_list(name, src=leader)
    return Path(path) / name[0]


def flat_whole(state):
    """A whole state's model and optimizer in flat_state's keys ("model.<name>",
    "optimizer.state.<name>. <key>", "optimizer.param_groups.<name>.<key>"), as get_state_dict
    flattens an optimizer's state."""
    flat = {f"model.{name}": value for name, value in state["model"].items()}
    for name, values in state["optimizer"]["state"].items():
        flat |= {f"optimizer.state.{name}.{key}": value for key, value in values.items()}
    for group in state["optimizer"]["param_groups"]:
        settings = {key: value for key, value in group.items() if key != "params"}
        for name in group["params"]:
            flat |= {f"optimizer.param_groups.{name}.{key}": value for key, value in settings.items()}
    return flat


def whole_state(model, optimizer):
    """(model, optimizer) state dicts in full, in get_state_dict's form (parameter names as keys):
    what a single-file snapshot holds. For one process holding the whole model (export.py)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(model, optimizer)
