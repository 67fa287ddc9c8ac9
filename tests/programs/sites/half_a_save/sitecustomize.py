"""sitecustomize for the example's process: its second torch.save writes half a file, then fails or dies

Started by tests/lessons/test_snapshots.py."""

import os
import signal

import torch

_save, _calls = torch.save, []


def save(obj, f, *args, **kwargs):
    _calls.append(1)
    if len(_calls) < 2:
        return _save(obj, f, *args, **kwargs)
    with open(f, "wb") as out:  # the lessons save to a path
        out.write(b"PK\x03\x04 the first half of a zip file")
        out.flush()
        if os.environ["HOW"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
    raise OSError("disk full")


torch.save = save
