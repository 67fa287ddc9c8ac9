"""Runs train.py (the rest of the command line), but every preparation of text into shards first says
`preparing in local rank N` and waits $SLOW_PREPARE seconds: longer than the others' --timeout.

Started by tests/gpt/test_gpt_data.py."""

import os
import runpy
import sys
import time

import prepare

_prepare = prepare.prepare


def slow_prepare(*args, **kwargs):
    print(f"preparing in local rank {os.environ.get('LOCAL_RANK')}", flush=True)
    time.sleep(float(os.environ["SLOW_PREPARE"]))
    return _prepare(*args, **kwargs)


prepare.prepare = slow_prepare
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
