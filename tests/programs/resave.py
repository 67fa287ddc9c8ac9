"""What train.py does with a snapshot, plus one save into ./resaved right after loading it: the state as
this number of processes holds it, before any step.

Started by tests/gpt/test_gpt_sharding.py."""

import dataclasses
import os
import sys

import data
from config import parse_args
from failures import preempt
from processes import setup_processes
from snapshots import checkpoint, train_state
from snapshots.train_state import snapshot_config
from trainer import Trainer

sys.argv = sys.argv[1:]
parser, args = parse_args()
corpus = data.load_corpus(args.data, args.cache_dir, args.timeout, args.tokenizer, args.vocab_size)
snapshot = checkpoint.load(args.snapshot_path, snapshot_config(args, corpus))
rank, world, device = setup_processes()
trainer = Trainer(args, corpus, snapshot, rank, world, device)
trainer.args = dataclasses.replace(args, snapshot_path="resaved")  # the Config is frozen
train_state.save(trainer, train_state.rng_state(device))
trainer.args = args
trainer.train(preempt.StopRequest())
sys.stdout.flush()
os._exit(0)  # as train.py ends: the group's gloo threads, still held, could abort a normal shutdown
