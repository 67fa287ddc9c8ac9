"""What train.py does with a snapshot, plus one save into ./resaved right after loading it: the state as
this number of processes holds it, before any step.

Started by tests/test_gpt_sharding.py."""

import dataclasses
import os
import sys

import checkpoint
import data
import preempt
import train_state
from config import parse_args
from train_state import snapshot_config
from trainer import Trainer, setup_processes

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
