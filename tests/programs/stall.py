"""Runs train.py with process 1 stalled before its first step: process 0 waits for it in a collective. With
STALL_LOSES=1, process 0's collective fails instead as gloo's do on the others when one process gives up
first: the connection closed by that peer, before process 0's own timeout (process 1 sleeps: alive, its
watcher answers).

Started by tests/gpt/test_gpt.py."""

import os
import runpy
import signal
import sys
import time

import trainer

train = trainer.Trainer.train


def stalled(self, *args):
    if self.rank == 1:
        # torchrun's SIGTERM, once process 0 has failed, ends it at once: the trainer's own handler would
        # wait for a step it never reaches, and torchrun 30 s before it kills it
        signal.signal(signal.SIGTERM, lambda *_: os._exit(128 + signal.SIGTERM))
        time.sleep(600)
    if os.environ.get("STALL_LOSES"):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:39085")
    return train(self, *args)


trainer.Trainer.train = stalled
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
