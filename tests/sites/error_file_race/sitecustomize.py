"""Loaded at start-up by every Python process with this folder on PYTHONPATH (tests/test_fault_tolerance.py).

torch's race, made certain once: the first worker whose @record writes an error file (the survivor of a
killed peer) opens it and then waits, so that torchrun's SIGTERM finds the file empty and the agent dies
reading it. ERROR_FILE_RACE_MARK is created at that moment; while it exists, errors are recorded as usual.
"""

import os
import threading

from torch.distributed.elastic.multiprocessing.errors import error_handler

record_as_usual = error_handler.ErrorHandler.record_exception


def record_once_cut_short(self, error):
    path = self._get_error_file_path()
    mark = os.environ["ERROR_FILE_RACE_MARK"]
    if path is None or os.path.exists(mark):
        return record_as_usual(self, error)
    open(mark, "w").close()
    with open(path, "w"):
        threading.Event().wait()  # until the agent's SIGTERM


if "TORCHELASTIC_ERROR_FILE" in os.environ:
    error_handler.ErrorHandler.record_exception = record_once_cut_short
