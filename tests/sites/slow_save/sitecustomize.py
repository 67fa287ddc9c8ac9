"""sitecustomize: every torch.save waits $SLOW_SAVE seconds first, so that a kill lands during a save.

Started by tests/test_fault_tolerance.py."""

import os
import time

import torch

_save = torch.save


def save(*args, **kwargs):
    time.sleep(float(os.environ["SLOW_SAVE"]))
    return _save(*args, **kwargs)


torch.save = save
