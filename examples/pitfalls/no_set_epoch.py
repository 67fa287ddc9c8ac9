"""Pitfall: a DistributedSampler without set_epoch. It shuffles with a seed plus its epoch number, which
stays 0 unless the loop sets it: every epoch then serves every rank the same samples in the same order.

python examples/pitfalls/no_set_epoch.py [--fixed]    # --fixed: sampler.set_epoch(epoch) every epoch
"""

import argparse
import sys

from torch.utils.data import DistributedSampler


def orders(fixed, epochs=3, rank=0):
    """The sample order rank 0 of 2 gets in each epoch. No process group: the sampler needs none."""
    sampler = DistributedSampler(range(16), num_replicas=2, rank=rank, shuffle=True, seed=0)
    seen = []
    for epoch in range(epochs):
        if fixed:
            sampler.set_epoch(epoch)  # the fix: a new order each epoch, still the same on every rank
        seen.append(list(sampler))
    return seen


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixed", action="store_true", help="apply the fix")
    args = parser.parse_args()
    seen = orders(args.fixed)
    for epoch, order in enumerate(seen):
        print(f"seen: epoch {epoch}, rank 0 of 2 gets samples {order}", flush=True)
    if len({tuple(order) for order in seen}) == 1:
        sys.exit(
            "cause: no set_epoch: the sampler shuffled every epoch alike, so the model sees one order "
            "over and over; fix: call sampler.set_epoch(epoch) at the start of each epoch (--fixed)"
        )
    print(f"fixed: {len(seen)} epochs, {len({tuple(o) for o in seen})} different orders", flush=True)


if __name__ == "__main__":
    main()
