"""Train a GPT: one process, or one per GPU (or 2 on CPU) under torchrun, DDP by default or any
layout of pipeline, data-parallel (replicated, sharded) and tensor-parallel processes on one mesh.

    python examples/gpt/train.py                                  # one process, the default corpus
    torchrun --standalone --nproc-per-node=2 examples/gpt/train.py --max_steps 500
    torchrun --standalone --nproc-per-node=8 examples/gpt/train.py --pp 2 --dp_shard 2 --tp 2
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node=2 --max-restarts=3 \\
        examples/gpt/train.py                                     # restarted processes resume
    python examples/gpt/prepare.py --out /shared/stdlib           # once: every node trains on the same data
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        examples/gpt/train.py --model gpt2 --data /shared/stdlib --snapshot_path /shared/gpt

The folder is self-contained: copy it, it needs torch alone (and `tokenizers` for a BPE
tokenizer). Run with --help for every option. Text is tokenized into shards first
(prepare.py, or here into the cache).
"""

import os
import socket

import data
import torch
import torch.distributed as dist
from config import parse_args
from failures import failure, guards, hang, preempt
from processes import all_ranks, setup_processes
from snapshots import checkpoint, hf
from snapshots.train_state import from_hf, snapshot_config
from trainer import Trainer


def main():
    parser, args = parse_args()
    gpus, local_procs = torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if gpus and local_procs > gpus:
        parser.error(f"{local_procs} processes per node but only {gpus} GPUs: lower --nproc-per-node")
    # Everything that can be wrong with the input is found here, in every process, before any
    # process group forms or any file is written.
    try:
        corpus = data.load_corpus(args.data, args.cache_dir, args.timeout, args.tokenizer, args.vocab_size)
        corpus.check(args.block_size)
    except data.DataError as exc:
        parser.error(str(exc))
    try:
        snapshot = checkpoint.load(args.snapshot_path, snapshot_config(args, corpus))
        if snapshot is None and hf.is_folder(args.init_from):  # a Hugging Face GPT-2, to fine-tune
            snapshot = from_hf(args, corpus)
        elif snapshot is None and args.init_from:
            snapshot = checkpoint.load_file(args.init_from, snapshot_config(args, corpus))
    except hf.HFError as exc:
        parser.error(str(exc))
    except checkpoint.SnapshotError as exc:
        failure.fail(f"error: {exc}")
    stop = preempt.StopRequest()  # from here on SIGTERM or Ctrl-C ends the run at a step's boundary, saved
    hang.record(args.snapshot_path)  # every collective in torch's flight recorder, read on a timeout
    try:
        rank, world, device = setup_processes(args.dist_timeout)
    except RuntimeError as exc:  # the others never came to the rendezvous
        failure.timed_out(args, int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), exc)
    hang.arm(args.snapshot_path, rank, world)  # dumps when another process's collective times out
    differ = data.disagreement(all_ranks((corpus.data_digest, socket.gethostname())))
    if differ:  # each node prepared its own corpus, or was given another folder
        failure.fail(f"error: the processes would train on different data: {differ}: prepare it once "
                     "(examples/gpt/prepare.py --out DIR) on storage every node shares and pass --data DIR "
                     "on every node")  # fmt: skip
    steps = set(all_ranks(-1 if snapshot is None else int(snapshot["step"])))
    if len(steps) > 1:  # a node without the snapshot would start over while the others resume
        failure.fail(f"error: the processes found different snapshots (steps {sorted(steps)}; -1: none): put "
                     "--snapshot_path on a filesystem that every node shares")  # fmt: skip
    leads = rank == args.layout.leader  # the process that speaks for all
    if snapshot is not None and leads:
        source = args.snapshot_path if "shards" in snapshot else args.init_from
        taken = f" ({os.path.basename(snapshot['shards'])})" if "shards" in snapshot else ""
        print(f"resuming from {source} at step {snapshot['step']}{taken}", flush=True)
    if snapshot is not None and snapshot["step"] >= args.max_steps:
        if leads:
            print(f"{args.snapshot_path} already holds {snapshot['step']} steps, nothing to train: "
                  "raise --max_steps to go on", flush=True)  # fmt: skip
    else:
        try:
            trainer = Trainer(args, corpus, snapshot, rank, world, device)
            del snapshot  # a single file's tensors (--init_from): written as the run's first snapshot
            trainer.train(stop)
        except checkpoint.SnapshotError as exc:  # a snapshot's data, read by every process here
            failure.fail(f"error: {exc}")
        except guards.Diverged as exc:
            failure.diverged(exc, args.snapshot_path)
        except RuntimeError as exc:  # gloo and NCCL say "Timed out" when --dist_timeout passes
            failure.timed_out(args, rank, world, exc)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    failure.leave(0, group_formed=True)  # trained and written
