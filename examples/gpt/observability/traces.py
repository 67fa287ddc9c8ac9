"""--profile_steps A:B: torch.profiler records steps A to B of every process; each writes one trace
(FOLDER/rank{R}.json, Chrome's trace format: open it in ui.perfetto.dev or chrome://tracing) and
prints where its time went: in compute, in collectives, and how much of the collectives ran while
it computed (DDP's all-reduce of one bucket overlapping the backward pass of the next, for one)."""

import argparse
import json
import os

from torch.profiler import ProfilerActivity, profile

# kineto, the profiler's engine, logs at its start and stop (level 5, USDT: written in two parts to
# stderr, so another process's line can land inside it), and on a machine without GPUs an ERROR line
# that is not one: 6 silences them all
os.environ.setdefault("KINETO_LOG_LEVEL", "6")


class StepProfiler:
    """Call at_step(s) before each step s (counted from 1): the profiler runs from step `first` to
    the end of step `last`, then writes and summarises the trace."""

    def __init__(self, steps, folder, rank, device):
        (self.first, self.last), self.folder, self.rank = steps, folder, rank
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.profiler = profile(activities=activities)
        self.running = False

    def at_step(self, step):
        if step == self.first:
            self.profiler.start()
            self.running = True
        elif step == self.last + 1 and self.running:
            self.finish()

    def finish(self):
        """Stop (a run ending inside the range keeps what it recorded), write and summarise."""
        if not self.running:
            return
        self.profiler.stop()
        self.running = False
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, f"rank{self.rank}.json")
        self.profiler.export_chrome_trace(path)
        with open(path) as f:
            times = breakdown(json.load(f))
        overlap = times["overlapped"] / times["collectives"] if times["collectives"] else 0.0
        line = (
            f"[rank {self.rank}] steps {self.first}-{self.last} traced to {path}: compute "
            f"{times['compute']:.1f} ms, collectives {times['collectives']:.1f} ms, of which "
            f"{times['overlapped']:.1f} ms ({overlap:.0%}) overlapped compute\n"
        )
        print(line, end="", flush=True)  # one write with its newline: every rank's line shares the output


def is_collective(event):
    """gloo's and NCCL's own spans (their threads, on the CPU) and NCCL's kernels (on the GPU)."""
    name = event["name"].lower()
    return name.startswith(("gloo:", "nccl:")) or (event.get("cat") == "kernel" and "nccl" in name)


def is_compute(event, gpu):
    """Kernels on a GPU; on a CPU, the operators the process runs itself, not the ones that hand a
    collective to its backend."""
    if is_collective(event):
        return False
    if gpu:
        return event.get("cat") == "kernel"
    return event.get("cat") == "cpu_op" and not event["name"].startswith(("c10d::", "record_param_comms"))


def breakdown(trace):
    """{compute, collectives, overlapped}: milliseconds covered by compute spans, by
    collective spans, and by both at once, in a trace in Chrome's format (spans of one kind on
    several threads count once)."""
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    gpu = any(e.get("cat") == "kernel" for e in spans)
    compute = union([(e["ts"], e["ts"] + e["dur"]) for e in spans if is_compute(e, gpu)])
    collectives = union([(e["ts"], e["ts"] + e["dur"]) for e in spans if is_collective(e)])
    return {
        "compute": length(compute) / 1000,
        "collectives": length(collectives) / 1000,
        "overlapped": length(intersect(compute, collectives)) / 1000,
    }


def union(intervals):
    """Sorted disjoint intervals covering these."""
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def intersect(a, b):
    """The intersection of two sorted disjoint interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append([start, end])
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def length(intervals):
    return sum(end - start for start, end in intervals)


def step_range(text):
    """'A:B' -> (A, B), steps counted from 1, A <= B."""
    try:
        first, last = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FIRST:LAST, two step numbers, got {text!r}") from None
    if not 1 <= first <= last:
        raise argparse.ArgumentTypeError(f"expected 1 <= FIRST <= LAST, got {text!r}")
    return first, last
