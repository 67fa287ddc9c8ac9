"""A picture of the traces that train.py --profile_steps writes: for each process, the spans in compute and
in collectives on one time axis, and the breakdown traces.py prints.

    python benchmarks/plot_trace.py runs/gpt/traces docs/images/trace-ddp.png
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))
from observability import (
    traces,  # examples/gpt/observability/traces.py: what counts as compute and as a collective
)


def spans(trace):
    """(compute, collectives): sorted disjoint [start, end] intervals in microseconds."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    gpu = any(e.get("cat") == "kernel" for e in events)
    kinds = (lambda e: traces.is_compute(e, gpu), traces.is_collective)
    return [traces.union([(e["ts"], e["ts"] + e["dur"]) for e in events if kind(e)]) for kind in kinds]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path, help="the traces' folder (train.py's --profile_dir)")
    p.add_argument("out", type=Path, help="the PNG to write")
    args = p.parse_args()
    files = sorted(args.folder.glob("rank*.json"), key=lambda f: int(f.stem.removeprefix("rank")))
    if not files:
        p.error(f"{args.folder} holds no rank*.json trace")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loaded = [json.loads(f.read_text()) for f in files]
    parts = [spans(t) for t in loaded]
    origin = min(iv[0][0] for compute, collectives in parts for iv in (compute, collectives) if iv)
    fig, ax = plt.subplots(figsize=(12, 1 + 0.9 * len(files)))
    labels = []
    for row, (f, trace, (compute, collectives)) in enumerate(zip(files, loaded, parts, strict=True)):
        y = 2 * row
        for level, intervals, colour in ((y + 1, compute, "tab:blue"), (y, collectives, "tab:orange")):
            bars = [((s - origin) / 1000, (e - s) / 1000) for s, e in intervals]
            ax.broken_barh(bars, (level - 0.4, 0.8), facecolors=colour)
        t = traces.breakdown(trace)
        labels += [
            f"{f.stem} collectives {t['collectives']:.0f} ms ({t['overlapped']:.0f} ms overlapped)",
            f"{f.stem} compute {t['compute']:.0f} ms",
        ]
    ax.set_yticks(range(2 * len(files)), labels)
    ax.set_xlabel("ms from the first span")
    ax.set_title("compute (blue) and collectives (orange) of each process, on one clock")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
