"""The DDP tutorial's single-GPU training loop: benchmarks/lessons.py's baseline (its `tutorial` variant).

    python benchmarks/tutorial_loop.py 10 5 --batch_size 32 [--loss mse]

The work per step and per epoch is that of the upstream tutorial's single_gpu.py: random samples
(torch.rand(20), torch.rand(1)) served by a Dataset subclass whose __getitem__ indexes a list (the
tutorial's datautils), a shuffling DataLoader, Linear(20, 1) and SGD at lr 1e-3; per step
zero_grad, forward, the tutorial's F.cross_entropy, backward and step; per epoch one batch read to print the
batch size and one line printed; every save_every epochs the model's state saved. Cross-entropy over a single
output is identically zero, so this loop learns nothing, like the tutorial's: it measures what a step
costs. `--loss mse` takes the lessons' loss instead (one fused operation, cheaper than the cross-entropy's
several), for a like-for-like comparison of the loops. One addition, for the bench to time as it does the
lessons: each epoch ends by printing the lessons' line, "epoch 3/10 | loss 0.5 | world_size 1", the loss
being the epoch's last batch's, which costs nothing per step. It comes after the epoch's save: with the
bench's save_every (the epoch count) this loop saves in its first epoch, which the bench leaves out, and the
lessons after their last line, so no measured epoch holds a save.
"""

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


class RandomSamples(Dataset):
    """Random inputs and targets, drawn once and held in a list."""

    def __init__(self, size):
        self.samples = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return self.samples[index]


def train(args):
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    samples = RandomSamples(args.dataset_size)
    loader = DataLoader(samples, batch_size=args.batch_size, shuffle=True, pin_memory=device.type == "cuda")
    model = torch.nn.Linear(20, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = F.mse_loss if args.loss == "mse" else F.cross_entropy
    for epoch in range(args.total_epochs):
        batch_size = len(next(iter(loader))[0])  # the tutorial's way of finding the batch size
        print(f"[{device}] epoch {epoch} | batch size {batch_size} | {len(loader)} steps", flush=True)
        for source, targets in loader:
            source, targets = source.to(device), targets.to(device)
            optimizer.zero_grad()
            loss = loss_fn(model(source), targets)
            loss.backward()
            optimizer.step()
        if epoch % args.save_every == 0:
            torch.save(model.state_dict(), args.snapshot_path)
            print(f"epoch {epoch}: model saved to {args.snapshot_path}", flush=True)
        print(f"epoch {epoch + 1}/{args.total_epochs} | loss {loss.item():.6g} | world_size 1", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("total_epochs", type=int, help="epochs to train")
    parser.add_argument("save_every", type=int, help="save the model every this many epochs")
    parser.add_argument("--batch_size", type=int, default=32, help="samples per step (default 32)")
    parser.add_argument("--dataset_size", type=int, default=2048, help="random samples (default 2048)")
    parser.add_argument("--seed", type=int, default=0, help="seed for data, weights and shuffling")
    parser.add_argument("--snapshot_path", default="checkpoint.pt", help="where the model is saved")
    parser.add_argument(
        "--loss", choices=["cross_entropy", "mse"], default="cross_entropy", help="default: the tutorial's"
    )
    args = parser.parse_args(argv)
    for name in ["total_epochs", "save_every", "batch_size", "dataset_size"]:
        if getattr(args, name) <= 0:
            parser.error(f"{name} must be positive, got {getattr(args, name)}")
    train(args)


if __name__ == "__main__":
    main()
