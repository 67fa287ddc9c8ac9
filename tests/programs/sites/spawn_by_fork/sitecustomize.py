"""On PYTHONPATH: the processes torch.multiprocessing.spawn would start as fresh interpreters are forked from
their parent instead, which has imported torch already (2-3 CPU-seconds saved for each). For the runs whose
subject is what the processes do, not how they start: tests/repo/test_pitfalls.py's report and
tests/lessons/test_fault_tolerance.py's eight runs at once. Every other mp.spawn run of the suite spawns."""

import multiprocessing

_get_context = multiprocessing.get_context


def get_context(method=None):
    return _get_context("fork" if method == "spawn" else method)


multiprocessing.get_context = get_context
