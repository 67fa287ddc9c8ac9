"""How the processes share the work: one device mesh and a small function per parallelism.

    mesh.py               Layout, its refusals, build_mesh: pp x dp_replicate x dp_shard x tp
    pipeline_parallel.py  split_stage: a stage's blocks; Pipeline runs the schedule
    tensor_parallel.py    apply_tp: every block's four matrices split over mesh["tp"]
    data_parallel.py      apply_fsdp (dp_shard, HSDP), apply_ddp, make_optimizer (zero)
    apply.py              parallelize(): --ac, pp, tp, --compile, FSDP or DDP, initial values
    runner.py             Parallel: the split model behind one interface, what the trainer runs
    grad_norm.py          clip_grad_norm_ over the whole model, wherever its parts live
    replicas.py           the end-of-run comparison of replicas, by digests
    dtensors.py           local, whole: a tensor as this process holds it, or whole

Read them side by side with docs/parallelism.md. The trainer's calls are named here.
"""

from parallel.apply import parallelize
from parallel.data_parallel import local_optimizer, make_optimizer
from parallel.grad_norm import clip_grad_norm_
from parallel.mesh import resolve_dtype
from parallel.replicas import check_replicas, replica_digests

__all__ = [
    "check_replicas",
    "clip_grad_norm_",
    "local_optimizer",
    "make_optimizer",
    "parallelize",
    "replica_digests",
    "resolve_dtype",
]
