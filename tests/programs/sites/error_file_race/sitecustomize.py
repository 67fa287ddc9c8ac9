"""Loaded at start-up by every Python process with this folder on PYTHONPATH
(tests/lessons/test_fault_tolerance.py).

torch's race, made certain once: the survivor of a killed peer is caught writing its error file when
torchrun's SIGTERM comes, so that the agent finds the file empty and dies reading it. Whichever comes first
in that worker leaves the file so: its @record writing an error (the file opened, then a wait for the
SIGTERM), or the SIGTERM itself (the file created empty, then the usual death by SIGTERM), since a worker
busy computing when its peer died meets the SIGTERM before any error. ERROR_FILE_RACE_MARK is created at
that moment; while it exists, errors and SIGTERMs take their usual course.
"""

import os
import signal
import threading

from torch.distributed.elastic.multiprocessing.errors import error_handler

record_as_usual = error_handler.ErrorHandler.record_exception


def first_time():
    """True once: the mark did not exist, and now does."""
    mark = os.environ["ERROR_FILE_RACE_MARK"]
    if os.path.exists(mark):
        return False
    open(mark, "w").close()
    return True


def record_once_cut_short(self, error):
    path = self._get_error_file_path()
    if path is None or not first_time():
        return record_as_usual(self, error)
    with open(path, "w"):
        threading.Event().wait()  # until the agent's SIGTERM


def terminated(signum, frame):
    if first_time():
        open(os.environ["TORCHELASTIC_ERROR_FILE"], "w").close()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


if "TORCHELASTIC_ERROR_FILE" in os.environ:
    error_handler.ErrorHandler.record_exception = record_once_cut_short
    signal.signal(signal.SIGTERM, terminated)
