"""sitecustomize: every torch.save waits $SLOW_SAVE seconds first, so that a kill lands during a save.
With $SLOW_SAVE_MARK set, the first save to begin creates that file first: when the wait started.

Started by tests/lessons/test_fault_tolerance.py."""

import os
import time

import torch

_save = torch.save


def save(*args, **kwargs):
    mark = os.environ.get("SLOW_SAVE_MARK")
    if mark:
        with open(mark, "a"):  # created once; its modification time: the first save's start
            pass
    time.sleep(float(os.environ["SLOW_SAVE"]))
    return _save(*args, **kwargs)


torch.save = save
