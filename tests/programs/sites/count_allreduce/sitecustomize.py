"""On PYTHONPATH: each DistributedDataParallel counts the gradient all-reduces its backward passes start
and prints, at exit, `gradient all-reduces: N (rank R)`. The count goes through a communication hook that
calls torch's own all-reduce hook (the same sum, the same division by the world size).
tests/lessons/test_recipe.py reads the lines: one all-reduce an optimizer step, whatever --grad_accum is."""

import atexit
import os

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

_original_init = DistributedDataParallel.__init__


def _counting_init(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    calls = []

    def counted(state, bucket):
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    self.register_comm_hook(None, counted)
    rank = self.process_group.rank()
    atexit.register(lambda: os.write(1, f"gradient all-reduces: {len(calls)} (rank {rank})\n".encode()))


DistributedDataParallel.__init__ = _counting_init
