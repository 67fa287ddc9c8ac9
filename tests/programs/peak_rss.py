"""Runs a Python script of examples/gpt (the rest of the command line) in this process, then prints its peak
resident memory as the trainer measures it (memory.max_rss, this process's own): `peak RSS <bytes>`.

Started by tests/gpt/test_gpt_data.py."""

import runpy
import sys

sys.argv = sys.argv[1:]
sys.path.insert(0, str(__import__("pathlib").Path(sys.argv[0]).parent))
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    from observability.memory import max_rss

    print(f"peak RSS {max_rss()}", flush=True)
