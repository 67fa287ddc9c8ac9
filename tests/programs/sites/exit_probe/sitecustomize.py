"""On PYTHONPATH, reports at interpreter exit how many gloo threads are still running in this process, and
whether it joined a process group (a training process, not a launcher or a helper of multiprocessing).

destroy_process_group() should leave none: one still running while the interpreter shuts down can abort a
finished run. tests/lessons/test_examples.py starts the lessons with this folder on PYTHONPATH and reads the
lines.
"""

import atexit
import importlib.abc
import importlib.util
import os
import sys

C10D = "torch.distributed.distributed_c10d"
joined = []  # one entry once init_process_group was called in this process


class WatchInit(importlib.abc.MetaPathFinder):
    """Wraps init_process_group as torch.distributed's module of it is loaded, before torch.distributed
    re-exports it, so that every caller (the lessons, accelerate) goes through the wrapper."""

    def find_spec(self, name, path, target=None):
        if name != C10D:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            original = module.init_process_group

            def init_process_group(*args, **kwargs):
                joined.append(True)
                return original(*args, **kwargs)

            module.init_process_group = init_process_group

        spec.loader.exec_module = exec_module
        return spec


def report():
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    alive = sum("gloo" in name for name in names)
    group = "yes" if joined else "no"
    print(
        f"exit probe: pid {os.getpid()}, process group: {group}, gloo threads alive: {alive}",
        file=sys.stderr,
        flush=True,
    )


if os.path.isdir("/proc/self/task"):
    sys.meta_path.insert(0, WatchInit())
    atexit.register(report)
