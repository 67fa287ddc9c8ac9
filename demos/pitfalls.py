"""Run every script of examples/pitfalls broken, then with --fixed, and print one line each (make pitfalls).

    python demos/pitfalls.py [--json FILE] [--jobs N] [NAME ...]

A pitfall passes when its broken run fails (non-zero) within LIMIT seconds with its last line naming the
cause ("cause: ...") and its fixed run exits 0 within FIXED_LIMIT, or says it needs GPUs (SyncBatchNorm runs
on CUDA only; the runs here hide the GPUs). Exit status: 0 if every pitfall passes, else 1.
"""

import argparse
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PITFALLS = Path(__file__).resolve().parent.parent / "examples" / "pitfalls"
LIMIT = 120  # seconds: every pitfall bounds its own waits below this
FIXED_LIMIT = 300  # seconds for a --fixed run, which trains to its end: a busy machine needs longer


def run(script, fixed):
    """One run: its exit status (None if it outlived LIMIT), seconds, the lines it printed."""
    command = [sys.executable, str(script), *(["--fixed"] if fixed else [])]
    start = time.monotonic()
    # what it writes in the temporary folder (the dumps on a timeout: examples/gpt/failures/hang.py) goes
    # with the run
    with tempfile.TemporaryDirectory(prefix="pitfall-") as tmp:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1", "TMPDIR": tmp}
        # a session of its own: on a timeout the script and every process it started are killed together
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=FIXED_LIMIT if fixed else LIMIT)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code, output = None, proc.communicate()[0] or ""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return {"code": code, "seconds": round(time.monotonic() - start, 1), "lines": lines}


def check(name):
    broken, fixed = run(PITFALLS / f"{name}.py", False), run(PITFALLS / f"{name}.py", True)
    cause = broken["lines"][-1] if broken["lines"] else ""
    seen = next((line.removeprefix("seen: ") for line in broken["lines"] if line.startswith("seen: ")), "")
    needs_gpus = fixed["code"] == 2 and " error: --fixed needs " in (fixed["lines"] or [""])[-1]
    fixed_ok = fixed["code"] == 0 or needs_gpus
    return {
        "name": name,
        "broken": broken,
        "fixed": fixed,
        "seen": seen,
        "cause": cause.removeprefix("cause: ") if cause.startswith("cause: ") else None,
        "needs_gpus": needs_gpus,
        "ok": broken["code"] not in (0, None) and cause.startswith("cause: ") and fixed_ok,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="pitfalls to run (default: all)")
    parser.add_argument("--json", help="write every run's status, time and output here")
    parser.add_argument("--jobs", type=int, default=2, help="pitfalls run at a time (default 2)")
    args = parser.parse_args(argv)
    known = sorted(p.stem for p in PITFALLS.glob("*.py"))
    unknown = sorted(set(args.names) - set(known))
    if unknown:
        parser.error(f"no such pitfall: {', '.join(unknown)} (known: {', '.join(known)})")
    results = []
    print("Each pitfall runs broken (it fails, naming its cause), then with --fixed (it succeeds).")
    print(f"{'pitfall':22} | {'broken run':22} | {'what it showed':90} | --fixed", flush=True)
    # two at a time, said in order: most of a broken run is a wait for its timeout
    pool = concurrent.futures.ThreadPoolExecutor(args.jobs)
    for result in pool.map(check, args.names or known):
        name = result["name"]
        results.append(result)
        broken, fixed = result["broken"], result["fixed"]
        reproduced = broken["code"] not in (0, None) and result["cause"]
        ended = f"reproduced in {broken['seconds']} s" if reproduced else "NOT reproduced"
        ended = f"NO END in {LIMIT} s" if broken["code"] is None else ended
        seen = result["seen"] if len(result["seen"]) <= 90 else result["seen"][:87] + "..."
        done = f"fixed: {'yes' if fixed['code'] == 0 else 'no'} ({fixed['seconds']} s)"
        if result["needs_gpus"]:
            done = "fixed: needs GPUs"
        print(f"{name:22} | {ended:22} | {seen or '-':90} | {done}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
