"""Runs a Python script (the rest of the command line) in this process, then prints its peak resident memory:
`peak RSS <bytes>`, the high-water mark of this process alone.

Started by tests/test_gpt_data.py."""

import re
import runpy
import sys

sys.argv = sys.argv[1:]
sys.path.insert(0, str(__import__("pathlib").Path(sys.argv[0]).parent))
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    with open("/proc/self/status") as status:
        peak = int(re.search(r"VmHWM:\s+(\d+) kB", status.read()).group(1)) * 1024
    print(f"peak RSS {peak}", flush=True)
