"""A torchrun worker that prints its attempt (TORCHELASTIC_RESTART_COUNT) and exits with the status given.

torchrun --standalone --nproc-per-node=1 --max-restarts=2 tests/programs/exit_with.py 2
"""

import os
import sys

print("attempt", os.environ["TORCHELASTIC_RESTART_COUNT"], flush=True)
sys.exit(int(sys.argv[1]))
