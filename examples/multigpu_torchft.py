"""Step 3 with torchft: replica groups train as one; the rest go on without a lost one; it heals.

torchft_lighthouse --min_replicas 1 --join_timeout_ms 1000 &  # the referee: port 29510
torchrun --standalone --nproc-per-node=1 multigpu_torchft.py 40 5 --replica_group 0  # and 1: a group each
"""

import argparse
import difflib
import os
import sys
from datetime import timedelta

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset
from torchft import Manager, Optimizer, ProcessGroupGloo


class Trainer:
    def __init__(self, model, train_data, optimizer, loss_fn, device, args):
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.device = device
        self.args = args
        self.epochs_run = load_snapshot(args.snapshot_path, self.model, optimizer, device)
        wait = timedelta(seconds=args.timeout)
        # the lighthouse forms a quorum of groups for every step
        waits = {"timeout": wait, "connect_timeout": wait, "quorum_timeout": wait}
        self.pg = ProcessGroupGloo()
        self.manager = Manager(self.pg, None, None, args.min_replicas, **waits)
        # what a group that rejoins takes from a live peer
        self.manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
        self.manager.register_state_dict_fn("opt", optimizer.load_state_dict, optimizer.state_dict)
        self.manager.load_state_dict({"step": self.epochs_run * len(train_data), "batches_committed": 0})
        self.optimizer = Optimizer(self.manager, optimizer)  # steps only when every group commits

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        loss = self.loss_fn(self.model(source.to(self.device)), targets.to(self.device))
        loss.backward()
        # the mean over the groups (torchft's DDP wrapper does this per bucket)
        for p in self.model.parameters():
            self.manager.allreduce(p.grad).wait()
        loss = loss.detach()
        self.manager.allreduce(loss).wait()
        self.optimizer.step()
        return loss

    def _run_epoch(self, epoch):
        # a new order every epoch, the same in every run
        self.train_data.sampler.sampler.set_epoch(epoch)
        losses = []
        last_step = (epoch + 1) * len(self.train_data)
        for source, targets in self.train_data:
            step = self.manager.current_step()
            if step == last_step:
                break  # already committed by the peer this group healed from
            while self.manager.current_step() == step:  # a step not committed is tried again
                losses.append(self._run_batch(source, targets))
        return torch.stack(losses).mean()

    def train(self):
        epoch = self.manager.current_step() // len(self.train_data)
        while epoch < self.args.total_epochs:
            loss = self._run_epoch(epoch)
            epoch = self.manager.current_step() // len(self.train_data)
            # every group logs and saves its own snapshot
            progress = f"epoch {epoch}/{self.args.total_epochs} | loss {loss.item():.6g}"
            # the line and its newline in one write: a Ctrl-C cannot cut it in two
            print(f"{progress} | world_size {self.manager.num_participants()}\n", end="", flush=True)
            if epoch % self.args.save_every == 0 or epoch == self.args.total_epochs:
                save_snapshot(self.args.snapshot_path, self.model, self.optimizer, epoch)
        # torchft's threads and group end now: left to the interpreter's exit, they may abort it
        self.manager.shutdown()
        self.pg.shutdown()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=120, help="seconds to wait for others")
    parser.add_argument("--replica_group", type=int, default=0, help="this group's number: 0, 1, ...")
    parser.add_argument("--replica_groups", type=int, default=2, help="groups the data is split between")
    parser.add_argument("--min_replicas", type=int, default=1, help="groups a step needs")
    parser.add_argument("--lighthouse", default="http://localhost:29510", help="the lighthouse's address")
    args = get_args(parser)
    if not 0 <= args.replica_group < args.replica_groups or args.min_replicas < 1:
        parser.error("needs 0 <= --replica_group < --replica_groups and --min_replicas at least 1")
    if os.environ.get("LOCAL_WORLD_SIZE") != "1":
        parser.error(f"a group is one process: torchrun --standalone --nproc-per-node=1 {sys.argv[0]} ...")
    os.environ["TORCHFT_LIGHTHOUSE"] = args.lighthouse
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"[group {args.replica_group}/{args.replica_groups}] {device}, gloo", flush=True)
    train_set, model, optimizer, loss_fn = load_train_objs(args)
    # each group takes every replica_groups-th sample
    sampler = DistributedSampler(train_set, args.replica_groups, args.replica_group, seed=args.seed)
    # batch_size=None: whole batches, read at once
    batches = BatchSampler(sampler, args.batch_size, drop_last=False)
    train_data = DataLoader(train_set, sampler=batches, batch_size=None)
    try:
        Trainer(model, train_data, optimizer, loss_fn, device, args).train()
    except (RuntimeError, TimeoutError) as exc:
        # torchft's bounded waits: say what they waited for
        where = f"no quorum of {args.min_replicas} at {args.lighthouse}: {args.timeout:g} s"
        sys.exit(f"error: {exc!r}\n{where}")
    except KeyboardInterrupt:
        stopped(args.snapshot_path)


def refuse(message):
    sys.exit(message)


# Below: the same in every lesson (tests/repo/test_structure.py checks it).
def get_args(parser):
    parser.add_argument("total_epochs", type=int, help="epochs to train in all")
    parser.add_argument("save_every", type=int, help="epochs between snapshots")
    parser.add_argument("--batch_size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--snapshot_path", default=parser.prog.split(".")[0] + "_snapshot.pt")
    parser.add_argument("--dataset_size", type=int, default=2048)
    args, unknown = parser.parse_known_args()
    if unknown:  # a typo? the nearest name (argparse does so itself from Python 3.14)
        names = parser.format_usage().replace("[", " ").split()
        near = difflib.get_close_matches(unknown[0].split("=")[0], names, n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    for key in ["total_epochs", "save_every", "batch_size", "lr", "dataset_size"]:
        if not 0 < getattr(args, key) < float("inf"):  # nan fails this too
            parser.error(f"{key} must be positive and finite, got {getattr(args, key)}")
    if not 0 <= args.momentum < float("inf"):
        parser.error(f"momentum must be 0 or more and finite, got {args.momentum}")
    folder = os.path.dirname(args.snapshot_path) or "."  # now, not at the first save
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        parser.error(f"snapshot_path: no folder {folder} to write in; create it or give another")
    return args


def load_train_objs(args):
    """The same in every process: a linear regression, its data in two tensors; SGD as on GPUs."""
    torch.manual_seed(args.seed)
    inputs = torch.randn(args.dataset_size, 20)
    targets = inputs @ torch.randn(20, 1) + 0.01 * torch.randn(args.dataset_size, 1)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, args.momentum, foreach=True)
    return TensorDataset(inputs, targets), model, optimizer, torch.nn.functional.mse_loss


def save_snapshot(path, model, optimizer, epochs_run):
    state = {"MODEL_STATE": model.state_dict(), "OPTIMIZER_STATE": optimizer.state_dict()}
    torch.save({**state, "EPOCHS_RUN": epochs_run}, f"{path}.tmp.{os.getpid()}")
    os.replace(f"{path}.tmp.{os.getpid()}", path)  # atomic: a crash leaves the old one whole


def load_snapshot(path, model, optimizer, device):
    if not os.path.exists(path):
        return 0
    try:
        snapshot = torch.load(path, map_location=device, weights_only=True)  # data only, no code
        model.load_state_dict(snapshot["MODEL_STATE"])
        optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
    except Exception as exc:
        refuse(f"error: cannot resume from {path}: {exc!r}. Move it away to start again.")
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(f"resuming from {path}: {snapshot['EPOCHS_RUN']} epochs already run")
    return snapshot["EPOCHS_RUN"]


def stopped(path):
    """Ctrl-C: one process says what the same command resumes from (exit status 130)."""
    if os.environ.get("RANK", "0") == "0":
        where = "starts again (none saved)"
        if os.path.exists(path):  # the epochs since its last save are run again
            epochs = torch.load(path, weights_only=True)["EPOCHS_RUN"]
            where = f"resumes from {path} at epoch {epochs + 1}"
        print(f"stopped by Ctrl-C: the same command {where}", file=sys.stderr)
    sys.exit(130)


if __name__ == "__main__":
    main()
