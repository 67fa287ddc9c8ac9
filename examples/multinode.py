"""Step 4: several machines, a torchrun on each; they meet at the rendezvous, share the snapshot.

torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=NODE0:29500 --rdzv-id=job1 \
    --rdzv-conf=join_timeout=60,read_timeout=30 multinode.py 10 5 --snapshot_path /shared/snapshot.pt
"""

import argparse
import difflib
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn  # before any group forms, or the exit may abort
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset


def ddp_setup(wait):
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=wait)


class Trainer:
    def __init__(self, model, train_data, optimizer, loss_fn, device, args):
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.device = device
        self.args = args
        self.epochs_run = load_snapshot(args.snapshot_path, self.model, optimizer, device)
        runs = torch.tensor([self.epochs_run, -self.epochs_run], device=device)
        dist.all_reduce(runs, dist.ReduceOp.MAX)  # the most epochs any node found, and -the fewest
        if runs[0] != -runs[1]:
            refuse(f"the nodes found different snapshots at {args.snapshot_path}: share it")
        self.model = DDP(self.model)  # rank 0's weights everywhere; backward() averages gradients

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        loss = self.loss_fn(self.model(source.to(self.device)), targets.to(self.device))
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def _run_epoch(self, epoch):
        self.train_data.sampler.sampler.set_epoch(epoch)  # a new order each epoch, alike every run
        losses = [self._run_batch(source, targets) for source, targets in self.train_data]
        return torch.stack(losses).mean()

    def train(self):
        for epoch in range(self.epochs_run, self.args.total_epochs):
            loss = self._run_epoch(epoch)
            dist.all_reduce(loss)  # the sum over the processes; then their mean
            loss = loss / dist.get_world_size()
            progress = f"epoch {epoch + 1}/{self.args.total_epochs} | loss {loss.item():.6g}"
            if dist.get_rank() == 0:  # one process logs and saves for all
                # the line and its newline in one write: a Ctrl-C cannot cut it in two
                print(f"{progress} | world_size {dist.get_world_size()}\n", end="", flush=True)
                if (epoch + 1) % self.args.save_every == 0 or epoch + 1 == self.args.total_epochs:
                    save_snapshot(self.args.snapshot_path, self.model.module, self.optimizer, epoch + 1)


@record  # torchrun's summary shows this function's error, from its error file
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=120, help="seconds to wait for others")
    if "LOCAL_RANK" not in os.environ:
        parser.error(f"start me with torchrun on every node: torchrun --nnodes=2 ... {sys.argv[0]} ...")
    parser.error = refuse
    args = get_args(parser)
    shared_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if shared_store and os.environ.get("TORCHELASTIC_MAX_RESTARTS") != "0":
        refuse("restarts need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=2 ...")
    ddp_setup(timedelta(seconds=args.timeout))
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if torch.cuda.is_available() else "cpu")
    node = "local rank {LOCAL_RANK}/{LOCAL_WORLD_SIZE} on node {GROUP_RANK}".format(**os.environ)
    where = f"{device}, {dist.get_backend()}, {node} ({os.uname().nodename})"
    sys.stdout.write(f"[rank {dist.get_rank()}/{dist.get_world_size()}] {where}\n")
    train_set, model, optimizer, loss_fn = load_train_objs(args)
    sampler = DistributedSampler(train_set, seed=args.seed)  # a share: every world_size-th sample
    # batch_size=None: whole batches, read at once
    batches = BatchSampler(sampler, args.batch_size, drop_last=False)
    train_data = DataLoader(train_set, sampler=batches, batch_size=None)
    try:
        Trainer(model, train_data, optimizer, loss_fn, device, args).train()
    except KeyboardInterrupt:
        stopped(args.snapshot_path)
    dist.destroy_process_group()


def refuse(message):
    if dist.is_initialized():
        dist.destroy_process_group()
    if os.environ.get("LOCAL_RANK", "0") != "0":
        sys.exit(0)  # every process meets it alike: local rank 0 says why, the others end quietly
    raise argparse.ArgumentError(None, message) from None  # for @record, then __main__


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
    try:
        main()
    except argparse.ArgumentError as exc:
        if "TORCHELASTIC_ERROR_FILE" not in os.environ:
            print(exc, file=sys.stderr)  # no torchrun summary to show it (under mpirun, say)
        sys.exit(2)
