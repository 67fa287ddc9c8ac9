"""Which process hangs where. When a collective (or the rendezvous) passes its timeout,
every process still alive writes its Python stack and its flight-recorder entries to
FOLDER/hang/, and tools/why_hung.py (`make why-hung RUN=FOLDER`) says which process is in
which collective and which wrote nothing.

    hang.record(folder)                  # before the process group forms: torch records every collective
    dist.init_process_group(...)
    hang.arm(folder, rank, world)        # after: a thread that dumps when another process asks
    try:
        ...                              # training, collectives
    except RuntimeError as exc:          # "timed out"
        hang.dump(folder, rank, world, exc)   # dump, ask every other process to, wait (bounded) for them

Files, per process R: hang/rank{R}.stack.txt (rank, host, pid, why, the call that timed out, then
every thread's stack as faulthandler writes it) and hang/fr_rank{R} (torch's flight recorder,
pickled as torch's analyser reads it: `torchfrtrace FOLDER/hang -p fr_rank
--allow-incomplete-ranks` works on it too).

How the others learn that they should dump: the process that timed out sets a key in the rendezvous
store (MASTER_ADDR:MASTER_PORT: torchrun's, or rank 0's) and every armed process polls that key
from a daemon thread (every POLL seconds), so it dumps even while its main thread sleeps, computes
or waits in another collective. A stopped (SIGSTOP), dead or unreachable process writes nothing:
the report names it missing.

NCCL (written for GPUs, NOT yet run on one): a collective that times out there is noticed by NCCL's
watchdog thread, which ends the process (SIGABRT) rather than raising in Python. record() therefore
also turns on NCCL's own dump on timeout (TORCH_NCCL_DUMP_ON_TIMEOUT=1, files
TORCH_FR_DUMP_TEMP_FILE + rank = hang/fr_rank{R}, the same name and format as above; the watchdog
signals the other ranks through the store and each dumps its own), and arm() has faulthandler write
the Python stacks to hang/rank{R}.abort.txt when the process aborts. Values already in the
environment win.
"""

import atexit
import faulthandler
import os
import pickle
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

# The first flight-recorder dump imports torch._dynamo (its symboliser): 1.3 s of CPU here, and
# the import registers operators with torch's dispatcher. Done now, in the importing thread, so
# that a dump on a timeout is quick, and not in a second thread while this one runs operators
# (a thread did it before, the suspect of a heap corruption seen once in a tp run).
import torch._dynamo
import torch.distributed as dist

BUFFER = "2000"  # flight-recorder entries kept per process (a ring: the newest ones)
POLL = 0.5  # seconds between two looks at the store's dump key
WAIT = 10.0  # seconds that the process which timed out waits for the others' dumps
# How gloo fails a collective whose connection another
# process closed, having timed out first (or died)
PEER_GONE = ("connection closed by peer", "connection reset by peer", "timeout caused pair closure")


def cause(exc):
    """Whether an error out of a collective is a hang, as gloo and NCCL say it: "timed out" (this
    process waited past --dist_timeout), "lost" (gloo: another process, which timed out first or
    died, closed the connection), or None (another error, not a hang)."""
    text = str(exc).lower()
    if "timed out" in text:
        return "timed out"
    if any(words in text for words in PEER_GONE):
        return "lost"
    return None


_lock = threading.Lock()  # one writer of this process's files at a time (the main thread, the watcher)
_armed = {}  # store, stop event, abort file: set by arm()
_written = threading.Event()  # this process has dumped


def hang_dir(folder):
    path = Path(folder) / "hang"
    path.mkdir(parents=True, exist_ok=True)
    return path


def record(folder, nccl=None):
    """Before the process group forms (torch reads these when it does). torch 2.13 already keeps
    2000 entries for gloo by default (TORCH_FR_BUFFER_SIZE=0 turns the recorder off); other
    versions may not. nccl: the group will be NCCL's (default: when CUDA is available, as the GPT
    trainer chooses)."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", BUFFER)
    if torch.cuda.is_available() if nccl is None else nccl:  # not run on a GPU yet, see above
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(hang_dir(folder) / "fr_rank"))


def _key(name):
    # the store outlives a restart of torchrun's workers: one namespace per run and round
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return f"why_hung/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{name}"


def connect(timeout=30.0):
    """A client of the rendezvous store (torchrun's, or the one rank 0 serves for env://
    initialisation), a connection of its own beside the process group's. None without
    MASTER_ADDR/MASTER_PORT."""
    if not {"MASTER_ADDR", "MASTER_PORT"} <= set(os.environ):
        return None
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout))


def arm(folder, rank, world, store=None, poll=POLL):
    """After the process group formed: start the thread that dumps when another process asks.
    store: any c10d store that every process reaches (default: connect())."""
    try:
        store = store if store is not None else connect()
    except dist.DistError as exc:  # a diagnosis must not end the run: without the store, no watcher
        print(
            f"hang.py: no store to watch ({exc}): rank {rank} dumps on its own timeout only", file=sys.stderr
        )
    stop = threading.Event()
    _armed.update(store=store, stop=stop)
    nccl_dump = None
    if dist.is_initialized() and dist.get_backend() == "nccl":  # not run on a GPU yet, see above
        abort = (hang_dir(folder) / f"rank{rank}.abort.txt").open("w")
        abort.write(
            _header(rank, world, "aborted (NCCL's watchdog ends a process when a collective times out)")
        )
        abort.flush()
        faulthandler.enable(abort, all_threads=True)
        _armed["abort"] = abort  # open for as long as the process lives
        nccl_dump = hang_dir(folder) / f"fr_rank{rank}"  # where NCCL's watchdog dumps (record())
    if (store is not None and world > 1) or nccl_dump is not None:
        args = (store, folder, rank, world, poll, stop, nccl_dump, time.time())
        watcher = threading.Thread(target=_watch, args=args, name="why-hung", daemon=True)
        watcher.start()
        # stopped before the interpreter ends: a daemon thread still inside the store's C++ call
        # when Python finalises is ended there, and the process aborts ("terminate called without
        # an active exception")
        atexit.register(_disarm, stop, watcher, poll)


def _disarm(stop, watcher, poll):
    stop.set()
    watcher.join(timeout=poll + 5)  # one look at the store at most: a reply, or an error from a closed one


def _watch(store, folder, rank, world, poll, stop, nccl_dump, since):
    while not stop.wait(poll):
        if nccl_dump is not None and nccl_dump.exists() and nccl_dump.stat().st_mtime >= since:
            # NCCL's watchdog dumped this process's flight recorder: on its own timeout, or told by
            # another rank's through the store, while Python may be busy elsewhere. Add the stacks
            # (not run on a GPU).
            _write(folder, rank, world, "NCCL's watchdog dumped its flight recorder (a collective timed out)")
            return
        try:
            if store is None or not store.check([_key("dump")]):
                continue
            asker = store.get(_key("dump")).decode()
        except dist.DistError:  # the store's host ended or cannot be reached: no one will ask any more
            store = None
            if nccl_dump is None:
                return
            continue
        _write(folder, rank, world, f"asked by rank {asker}, whose collective timed out")
        _done(store, rank)
        return


def _done(store, rank):
    try:
        store.set(_key(f"done/{rank}"), socket.gethostname())
    except dist.DistError:
        pass


def dump(folder, rank, world, exc=None, wait=WAIT):
    """Write this process's stack and flight recorder, ask every armed process to do the
    same, and wait up to `wait` seconds for them. Returns the ranks that did not answer
    (stopped, dead, or not armed)."""
    store, stop = _armed.get("store"), _armed.get("stop")
    if stop is not None:
        stop.set()
    message = " ".join(str(exc).split("] ", 1)[-1].split()).split(". ")[0] if exc is not None else ""
    state = "timed out" if exc is None or cause(exc) == "timed out" else "failed"  # gloo's path cut
    why = f"{state}: {message}" if message else state
    _write(folder, rank, world, why, exc)
    waiting = set(range(world)) - {rank}
    if store is None:  # not armed (e.g. the rendezvous itself timed out): this process's own dump only
        return sorted(waiting)
    try:
        store.set(_key("dump"), str(rank))
        _done(store, rank)
        deadline = time.monotonic() + wait
        while waiting and time.monotonic() < deadline:
            waiting = {r for r in waiting if not store.check([_key(f"done/{r}")])}
            time.sleep(0.2 if waiting else 0)
    except dist.DistError:  # the store's host ended: no one else can be asked
        pass
    return sorted(waiting)


def _header(rank, world, why, exc=None):
    lines = [
        f"rank: {rank}",
        f"world: {world}",
        f"host: {socket.gethostname()}",
        f"pid: {os.getpid()}",
        f"time: {time.strftime('%Y-%m-%d %H:%M:%S %z')}",
        f"main thread: 0x{threading.main_thread().ident:016x}",  # as faulthandler names it below
        f"why: {why}",
    ]
    if exc is not None:
        lines.append(f"call: {_call(exc)}")
    return "\n".join(lines) + "\n\n"


def is_library(filename):
    """A frame of torch, another package or Python itself, not of the program being run."""
    markers = ("/site-packages/", "/dist-packages/", "/lib/python3", "<frozen", "<string>")
    return any(m in filename for m in markers) or os.path.basename(filename) == "hang.py"


def _call(exc):
    """FILE:LINE in FUNCTION -> OP: the program's last
    line in exc's traceback and what it called there."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [i for i, frame in enumerate(frames) if not is_library(frame.filename)]
    if not ours:
        return "?"
    frame = frames[ours[-1]]
    op = next((f.name for f in frames[ours[-1] + 1 :] if f.name != "wrapper"), "?")  # c10d_logger's
    return f"{frame.filename}:{frame.lineno} in {frame.name} -> {op}"


def _write(folder, rank, world, why, exc=None):
    hang = hang_dir(folder)
    with _lock:
        if _written.is_set():  # the first dump shows the hang; a later one, its aftermath
            return
        _written.set()
        partial = hang / f".partial-stack-{rank}"
        with partial.open("w") as out:
            out.write(_header(rank, world, why, exc))
            out.flush()
            faulthandler.dump_traceback(out, all_threads=True)
        partial.replace(hang / f"rank{rank}.stack.txt")
        trace = _flight_record()
        if trace is not None:
            partial = hang / f".partial-fr-{rank}"
            partial.write_bytes(trace)
            partial.replace(hang / f"fr_rank{rank}")


def _flight_record():
    """This process's flight-recorder entries, pickled as torch's analyser reads them, or None.
    torch has no public call for this: torch._C._distributed_c10d._dump_fr_trace (gloo) and
    _dump_nccl_trace (NCCL) are what its own tests and tutorial use."""
    c10d = torch._C._distributed_c10d
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    dumper = getattr(c10d, "_dump_nccl_trace" if nccl else "_dump_fr_trace", None)
    if dumper is None:
        return None
    data = pickle.loads(dumper())
    # gloo leaves the group table empty ({"": ranks []}), and torch's analyser needs it: fill it
    # in. A group that torch does not list (TORCH_DISTRIBUTED_DEBUG=DETAIL's own checks) is left
    # out: no rank is known.
    groups = _groups()
    config = {k: v for k, v in data.get("pg_config", {}).items() if k or v.get("ranks") != "[]"}
    for name, _ in {tuple(entry["process_group"]) for entry in data["entries"]}:
        if name not in config and name in groups:
            config[name] = groups[name]
    data["pg_config"] = config
    data["entries"] = [e for e in data["entries"] if not groups or e["process_group"][0] in config]
    return pickle.dumps(data)


def _groups():
    """Group name -> the analyser's record of it, for every process group this process is in. torch
    lists a group's ranks publicly (get_process_group_ranks) but not the groups themselves:
    _world.pg_names is the registry it keeps (private; without it, the default group alone)."""
    if not dist.is_initialized():
        return {}
    groups = getattr(dist.distributed_c10d, "_world", None)
    groups, ranks = list(getattr(groups, "pg_names", {})) or [dist.group.WORLD], dist.get_process_group_ranks
    return {
        pg.group_name: {"name": pg.group_name, "desc": pg.group_desc, "ranks": str(ranks(pg))}
        for pg in groups
    }
