"""The end-of-run comparison of replicas: every process's parts digested, and the digests of
processes that hold copies of the same part compared (nothing gathered)."""

import hashlib

import torch

from parallel.dtensors import local, sharded_dims
from parallel.mesh import DATA_DIMS
from parallel.pipeline_parallel import Pipeline


def replica_digests(parallel):
    """{kind: SHA-256 of this process's parts}, one kind per set of mesh dimensions the
    parameters are split along; "tied": the embedding copy of a pipeline's first and last
    stage. Processes that differ only along the other dimensions (those that replicate)
    must end with the same digest."""
    groups = {}
    for p in parallel.module.parameters():
        groups.setdefault(",".join(sharded_dims(p)), []).append(local(p))
    if isinstance(parallel, Pipeline) and (parallel.first or parallel.last):
        groups["tied"] = [local(parallel.module.tok_emb.weight)]
    out = {}
    for kind, tensors in groups.items():
        h = hashlib.sha256()
        for t in tensors:
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        out[kind] = h.hexdigest()[:16]
    return out


def replica_mismatches(layout, digests):
    """(compared, mismatches) from every rank's replica_digests, in rank order: for each kind,
    the ranks that share every coordinate but those of the dimensions replicating it are
    compared; mismatches names each set of ranks that disagree. Only digests travel: no
    process gathers another's weights."""
    classes = {}
    for rank, kinds in enumerate(digests):
        coords = layout.coords(rank)
        for kind, digest in kinds.items():
            if kind == "tied":  # across the pipeline's ends, every other coordinate the same
                key = tuple(coords[d] for d in DATA_DIMS)
            else:  # along the dimensions it is not split over, within one stage
                split = kind.split(",") if kind else []
                key = (coords["pp"], *(coords[d] for d in split))
            classes.setdefault((kind, key), []).append((rank, digest))
    compared = [members for members in classes.values() if len(members) > 1]
    mismatches = [
        f"{kind or 'whole'} weights of ranks {[r for r, _ in members]}: {[d for _, d in members]}"
        for (kind, _), members in classes.items()
        if len({d for _, d in members}) > 1
    ]
    return sum(len(m) for m in compared), mismatches


def check_replicas(layout, digests):
    """Processes that hold copies of the same part (along the dimensions that replicate it) must
    end with it bit for bit, compared by every rank's replica_digests (nothing gathered): the line
    to log, or RuntimeError naming the ranks that differ."""
    compared, mismatches = replica_mismatches(layout, digests)
    if mismatches:
        raise RuntimeError("replicas differ at the end of the run: " + "; ".join(mismatches))
    if not compared:
        return "no weights are replicated across processes in this layout: no replicas to compare"
    return f"replicas identical: {compared} copies compared across ranks"
