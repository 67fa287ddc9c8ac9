"""train.py, with process 1's batches late by $SLOW_MS milliseconds: as a slow disk or a busy core would
make them

Started by tests/gpt/test_gpt_metrics.py."""

import os
import runpy
import sys
import time

import data

gather = data.gather


def late_gather(*args, **kwargs):
    if os.environ["RANK"] == "1":
        time.sleep(float(os.environ["SLOW_MS"]) / 1000)
    return gather(*args, **kwargs)


data.gather = late_gather
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
