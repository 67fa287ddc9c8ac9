"""The table `make gpu-check` prints of its GPT-2 small runs (harness/gpu_check.sh): one row a run, from its
metrics after step 5 (the steps before hold the compilation): ms/step, tokens/s, peak memory, MFU by this
trainer's count and by llm.c's (model.flops_per_token), and the command that made it; then the fastest run
whose peak memory fits a 40 GB GPU, the one the gpt2 preset's defaults are to follow.

    python harness/gpu_table.py FOLDER NAME...    # reads FOLDER/NAME.jsonl (--metrics_path) and NAME.cmd
"""

import json
import sys
from pathlib import Path

WARMUP = 5  # steps left out: compilation, autotuning, the allocator's first requests
FITS = 40e9  # bytes of peak memory: a 40 GB GPU, with room left for the CUDA context and the allocator


def summary(metrics):
    """{step_ms, tokens_per_s, mfu, mfu_llmc, peak_bytes} over the log records past WARMUP (the rates
    weighted by time, as the whole span's), or None where the run logged none or ended before its memory."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    logged = [r for r in records if "step_ms" in r and r["step"] > WARMUP]
    peaks = [r["memory"]["peak_bytes"] for r in records if "memory" in r]
    if not logged or not peaks:
        return None
    time = sum(r["step_ms"] for r in logged)
    row = {"step_ms": time / len(logged), "peak_bytes": max(peaks)}
    for key in ("tokens_per_s", "mfu", "mfu_llmc"):  # no MFU where the trainer knows no peak
        row[key] = sum(r[key] * r["step_ms"] for r in logged) / time if key in logged[0] else None
    return row


def percent(value):
    return "-" if value is None else f"{100 * value:.1f}%"


def main():
    folder, names = Path(sys.argv[1]), sys.argv[2:]
    print(f"GPT-2 small, steps {WARMUP + 1} on; MFU by this trainer's count and by llm.c's")
    print("| run | ms/step | tokens/s | peak memory (MiB) | MFU | MFU (llm.c) | command |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    rows = {}
    for name in names:
        command = (folder / f"{name}.cmd").read_text().strip()
        row = rows[name] = summary(folder / f"{name}.jsonl")
        if row is None:
            print(f"| {name} | failed: see {folder / name}.txt | | | | | `{command}` |")
            continue
        numbers = f"{row['step_ms']:.1f} | {row['tokens_per_s']:,.0f} | {row['peak_bytes'] / 2**20:,.0f}"
        print(f"| {name} | {numbers} | {percent(row['mfu'])} | {percent(row['mfu_llmc'])} | `{command}` |")
    fitting = [name for name, row in rows.items() if row is not None and row["peak_bytes"] < FITS]
    if not fitting:
        print(f"no run's peak memory is under {FITS / 1e9:.0f} GB")
        return
    best = max(fitting, key=lambda name: rows[name]["tokens_per_s"])
    speed = f"{rows[best]['tokens_per_s']:,.0f} tokens/s"
    print(f"fastest under {FITS / 1e9:.0f} GB of peak memory: {best}, {speed}")


if __name__ == "__main__":
    main()
