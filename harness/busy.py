"""Run a command beside N busy processes, as on a machine shared with other jobs: each spins on one core
until the command ends; the command's exit status is this one's.

    python harness/busy.py 2 -- python -m pytest tests/lessons/test_examples.py    # `make test LOAD=2`
"""

import argparse
import multiprocessing
import subprocess
import sys


def spin():
    while True:
        pass


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("load", type=int, help="busy processes to run beside the command")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.load < 0 or not command:
        parser.error("give a load of 0 or more, then -- and a command")
    busy = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.load)]
    for process in busy:
        process.start()
    try:
        return subprocess.call(command)
    finally:
        for process in busy:
            process.kill()
            process.join()


if __name__ == "__main__":
    sys.exit(main())
