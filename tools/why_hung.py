"""Which process hangs where: read the dumps that examples/gpt/failures/hang.py has every process write when a
collective times out (FOLDER/hang/), and say in a few lines which process is in which collective, at which
sequence number and source line, and which processes wrote nothing.

    python tools/why_hung.py FOLDER          # make why-hung RUN=FOLDER

Lines: one per process (what it was doing, with the program's line, and its newest collective in torch's
flight recorder), one per process group (its newest collective: which processes entered it, which did not),
the finding of torch's own analyser (torchfrtrace) when it has one, and a verdict. Exit status 0 with the
report; 2 with one line when FOLDER holds no dumps.
"""

import argparse
import contextlib
import io
import json
import logging
import os
import pickle
import re
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

LIBRARY = ("/site-packages/", "/dist-packages/", "/lib/python3", "<frozen", "<string>")
FRAME_RE = re.compile(r'^\s+File "(.*)", line (\d+) in (\S+)')  # faulthandler's lines
THREAD_RE = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)")
CALL_RE = re.compile(r"(.*):(\d+) in (\S+) -> (\S+)$")  # hang.py's "call:" line
FR_RE = re.compile(r"fr_rank(\d+)")  # torch's flight recorder, one file per rank
MISSING = "wrote nothing (stopped, dead or unreachable, or not armed)"
STALE = 120  # seconds: dumps older than the newest by more than this are from an earlier timeout


def is_library(filename):
    return any(m in filename for m in LIBRARY) or os.path.basename(filename) == "hang.py"


def place(filename, line):
    rel = os.path.relpath(filename) if os.path.isabs(filename) else filename
    return f"{filename if rel.startswith('..') else rel}:{line}"


def plural(word, ranks):
    return f"{word}{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"


@dataclass
class Process:
    rank: int
    header: dict = field(default_factory=dict)  # hang.py's: host, pid, why, call
    doing: str = "no stack, its flight recorder only"
    op: str = ""  # the collective it timed out or waits in; "" when outside any
    where: str = ""  # FILE:LINE of the program where it is
    newest: dict = field(default_factory=dict)  # group -> (sequence number, op, FILE:LINE) of its newest


def read_stack(text):
    """(header fields, the main thread's frames, most recent first, as (file, line, function))."""
    head, _, body = text.partition("\n\n")
    header = dict(line.split(": ", 1) for line in head.splitlines() if ": " in line)
    threads, current = {}, None
    for line in body.splitlines():
        if m := THREAD_RE.match(line):
            current = threads.setdefault(m.group(1), [])
        elif (m := FRAME_RE.match(line)) and current is not None:
            current.append((m.group(1), int(m.group(2)), m.group(3)))
    return header, threads.get(header.get("main thread"), [])


def describe(proc, frames):
    """What the process was doing: the call that timed out, else what its main thread's stack shows."""
    why = proc.header.get("why", "")
    if why.startswith(("timed out", "failed")) and (m := CALL_RE.match(proc.header.get("call", ""))):
        proc.op, proc.where = m.group(4), place(m.group(1), m.group(2))
        proc.doing = f"{why.split(':')[0]} in {proc.op} at {proc.where} ({m.group(3)})"
        return
    ours = next((i for i, f in enumerate(frames) if not is_library(f[0])), None)
    if ours is None:
        proc.doing = why or "no frame of the program in its stack"
        return
    filename, line, function = frames[ours]
    proc.where = place(filename, line)
    called = [f[2] for f in frames[:ours] if f[2] != "wrapper"]  # c10d_logger's wrapper left out
    if any("/torch/distributed/" in f[0] for f in frames[:ours]):
        proc.op = called[-1]
        proc.doing = f"waiting in {proc.op} at {proc.where} ({function})"
    else:
        proc.doing = (
            f"outside any collective, at {proc.where} ({function}{' -> ' + called[-1] if called else ''})"
        )


def newest_collectives(entries):
    """group -> (sequence number, op, FILE:LINE that issued it) of the newest entry per process group. NCCL's
    entries also say how far the collective got (scheduled, started, completed): added to op."""
    newest = {}
    for entry in entries:
        frame = next((f for f in entry.get("frames", []) if not is_library(f["filename"])), None)
        seq = entry["p2p_seq_id"] if entry.get("is_p2p") else entry["collective_seq_id"]
        group = entry["process_group"][1] or entry["process_group"][0]
        line = place(frame["filename"], frame["line"]) if frame else "?"
        backend, _, op = entry["profiling_name"].rpartition(":")
        if backend == "nccl" and entry.get("state"):  # gloo's entries all stay "scheduled"
            op += f" ({entry['state']})"
        if seq >= newest.get(group, (-1,))[0]:
            newest[group] = (seq, op, line)
    return newest


def dump_files(hang):
    """The files of the newest timeout in hang/, and those older by more than STALE seconds (left over
    from an earlier one)."""
    files = [*hang.glob("rank*.stack.txt"), *(p for p in hang.glob("fr_rank*") if FR_RE.fullmatch(p.name))]
    # hang.py opens an abort file (NCCL) ahead of an abort: it counts once faulthandler has filled it
    files += [
        p for p in hang.glob("rank*.abort.txt") if "most recent call first" in p.read_text(errors="replace")
    ]
    if not files:
        return [], []
    newest = max(p.stat().st_mtime for p in files)
    fresh = [p for p in files if p.stat().st_mtime >= newest - STALE]
    return fresh, sorted(set(files) - set(fresh))


def load(files):
    """rank -> Process, and the world size the dumps name (0 if none does)."""
    procs, world = {}, 0
    for path in sorted(files, key=lambda p: p.name.endswith(".abort.txt")):  # a stack on demand wins
        if not path.name.endswith(".txt"):
            continue
        header, frames = read_stack(path.read_text(errors="replace"))
        rank = int(header.get("rank", -1))
        if rank >= 0 and rank not in procs:
            procs[rank] = Process(rank, header)
            describe(procs[rank], frames)
            world = max(world, int(header.get("world", 0)))
    for path in files:
        if m := FR_RE.fullmatch(path.name):
            data = pickle.loads(path.read_bytes())  # torch's flight recorder: dicts of plain values
            proc = procs.setdefault(int(m.group(1)), Process(int(m.group(1))))
            proc.newest = newest_collectives(data["entries"])
            for config in data.get("pg_config", {}).values():
                if config.get("desc") == "default_pg":
                    world = max(world, len(json.loads(config["ranks"])))
    for proc in procs.values():  # NCCL: collectives run on the GPU, Python waits elsewhere (a synchronize)
        pending = [c for c in proc.newest.values() if c[1].endswith(("(scheduled)", "(started)"))]
        if pending and not proc.op:
            seq, op, proc.where = pending[0]
            proc.op = op.split(" ")[0]
            proc.doing += f"; its {proc.op} #{seq} at {proc.where} has not completed"
    return procs, world


def torch_analyser(traces):
    """What torch's flight-recorder analyser (torchfrtrace) finds in these dumps: its messages that name a
    culprit or the ranks missing from a collective ([] when it finds nothing)."""
    logger = logging.getLogger("Flight Recorder")  # where it writes, with a handler it adds on import
    found, before = io.StringIO(), logger.handlers[:]
    try:
        with (
            tempfile.TemporaryDirectory() as folder,  # these dumps alone, as it reads a whole folder
            contextlib.redirect_stderr(io.StringIO()),
            contextlib.redirect_stdout(io.StringIO()),
        ):
            for path in traces:
                os.symlink(path.resolve(), os.path.join(folder, path.name))
            from torch.distributed.flight_recorder import fr_trace

            logger.handlers = [logging.StreamHandler(found)]
            fr_trace.main([folder, "-p", "fr_rank", "--allow-incomplete-ranks"])
    except ImportError:
        return []
    except Exception as exc:  # dumps it cannot read: said, and the report stands without it
        return [f"could not analyse the dumps ({type(exc).__name__}: {exc})"]
    finally:
        logger.handlers = before
    keep = ("error msg:", "Not all ranks joining", "Culprit")
    return [line.strip() for line in found.getvalue().splitlines() if line.strip().startswith(keep)]


def verdict(procs, missing, behind):
    """One line: who is the odd one out."""
    waiting = [p for p in procs.values() if p.op]
    busy = [p for p in procs.values() if p.header and not p.op]

    def at(p):
        seq = next((s for s, op, _ in p.newest.values() if op.split(" ")[0] == p.op), None)
        return f"{p.op}{f' #{seq}' if seq is not None else ''} ({p.where})"

    ops = Counter(p.op for p in waiting)
    wait = ""
    if len(ops) > 1:  # in different collectives: the odd ones are those in the rarer (or rank 0's other)
        usual = max(ops, key=lambda op: (ops[op], -min(p.rank for p in waiting if p.op == op)))
        ref = next(p for p in waiting if p.op == usual)
        odd = "; ".join(f"rank {p.rank} calls {at(p)}" for p in waiting if p.op != usual)
        wait = f"{odd} where rank {ref.rank} calls {at(ref)}"
        if not missing:
            return wait
        # with a process silent, the others' collectives differ by the one that ended on some of them only
    elif waiting:
        ranks = [p.rank for p in waiting]
        wait = f"{plural('rank', ranks)} wait{'s' * (len(ranks) == 1)} in {at(waiting[0])}"
    if missing:
        return f"{plural('rank', missing)} {MISSING}" + (f", while {wait}" if wait else "")
    if busy and waiting:
        return "; ".join(f"rank {p.rank} is {p.doing}" for p in busy) + f", while {wait}"
    if behind:
        return behind
    return f"every process is in the same collective, {at(waiting[0])}" if waiting else ""


def report(folder):
    """(lines, verdict) for FOLDER: a run's folder or its hang/ folder. FileNotFoundError when it holds no
    dumps."""
    hang = Path(folder) / "hang" if (Path(folder) / "hang").is_dir() else Path(folder)
    files, old = dump_files(hang) if hang.is_dir() else ([], [])
    procs, world = load(files)
    if not procs:
        raise FileNotFoundError(f"no dumps in {hang} (rank*.stack.txt, fr_rank*): did a collective time out?")
    world = max(world, max(procs) + 1)
    missing = sorted(set(range(world)) - set(procs))
    lines = [
        f"why-hung {hang}: {world} process{'es' * (world > 1)}; dumps from {plural('rank', sorted(procs))}"
    ]
    for rank, proc in sorted(procs.items()):
        host = f"{proc.header['host']}, pid {proc.header['pid']}" if "host" in proc.header else "?"
        seq, op, line = proc.newest.get("default_pg") or next(iter(proc.newest.values()), (None, "", ""))
        newest = f"; last collective #{seq} {op}{'' if line == proc.where else f' ({line})'}" if op else ""
        lines.append(f"rank {rank} ({host}): {proc.doing}{newest}")
    lines += [f"rank {rank}: {MISSING}" for rank in missing]
    behind = ""
    for group in sorted({g for p in procs.values() for g in p.newest}):
        seqs = {r: p.newest[group] for r, p in procs.items() if group in p.newest}
        top = max(seq for seq, _, _ in seqs.values())
        inside = [r for r, (seq, _, _) in sorted(seqs.items()) if seq == top]
        late = [r for r, (seq, _, _) in sorted(seqs.items()) if seq < top]
        text = f"collective #{top} of {group}: entered by " + ", ".join(
            f"rank {r} ({seqs[r][1]})" for r in inside
        )
        if late:
            text += "; not by " + ", ".join(f"rank {r} (last #{seqs[r][0]})" for r in late)
            _, op, line = seqs[inside[0]]
            behind = (
                behind or f"{plural('rank', late)} never entered collective #{top} ({op}, {line}) of {group}"
            )
        lines.append(text + "".join(f"; rank {r}: no dump" for r in missing))
    traces = [p for p in files if FR_RE.fullmatch(p.name)]
    lines += [f"torch's analyser: {line}" for line in (torch_analyser(traces) if traces else [])[:3]]
    if old:
        lines.append(f"left out, older than the others by over {STALE} s: {', '.join(p.name for p in old)}")
    found = verdict(procs, missing, behind) or "no process is in a collective in these dumps"
    return [*lines, f"verdict: {found}"], found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="the run's folder (holding hang/), or its hang/ folder")
    args = parser.parse_args(argv)
    try:
        lines, _ = report(args.folder)
    except FileNotFoundError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
