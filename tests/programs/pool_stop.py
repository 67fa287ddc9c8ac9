"""prepare.encode's pool, closed early (as by a reader that stops), ROUNDS times, in a process that
notes SIGTERM as the trainer does (preempt.StopRequest). A round that takes longer than LIMIT
seconds prints every thread's stack and ends the process with exit status 1. Started by
tests/gpt/test_gpt_prepare.py.

    python pool_stop.py ROUNDS LIMIT"""

import faulthandler
import json
import sys

import prepare
from failures import preempt


def main():
    rounds, limit = int(sys.argv[1]), int(sys.argv[2])
    preempt.StopRequest()
    spec = json.dumps({"type": "char", "vocab": "abc"})
    for _ in range(rounds):
        faulthandler.dump_traceback_later(limit, exit=True)
        pieces = prepare.encode(spec, [("abc" * 1000, True)] * 50, workers=2)
        for _ in range(3):
            next(pieces)
        pieces.close()  # the reader stops early: the pool ends
        faulthandler.cancel_dump_traceback_later()
    print(f"every pool ended, {rounds} rounds", flush=True)


if __name__ == "__main__":
    main()
