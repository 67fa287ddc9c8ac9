"""Step 3 with torchft: replica groups train as one; a lost group's peers go on, and it heals from them live.

torchft_lighthouse --min_replicas 1 --join_timeout_ms 1000 &  # the referee: port 29510, a status page there
torchrun --standalone --nproc-per-node=1 multigpu_torchft.py 40 5 --replica_group 0  # and 1: a group each
"""

import argparse
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler
from torchft import Manager, Optimizer, ProcessGroupGloo


class Trainer:
    def __init__(self, model, train_data, optimizer, loss_fn, device, args):
        self.device, self.model = device, model.to(device)
        self.train_data, self.optimizer, self.loss_fn, self.args = train_data, optimizer, loss_fn, args
        self.epochs_run = load_snapshot(args.snapshot_path, self.model, optimizer, device, args.total_epochs)
        wait = {f"{kind}timeout": timedelta(seconds=args.timeout) for kind in ("", "connect_", "quorum_")}
        self.manager = Manager(ProcessGroupGloo(), None, None, args.min_replicas, **wait)  # the lighthouse's
        for key, state in [("MODEL_STATE", model), ("OPTIMIZER_STATE", optimizer)]:  # a peer's live state
            self.manager.register_state_dict_fn(key, state.load_state_dict, state.state_dict)
        self.manager.load_state_dict({"step": self.epochs_run * len(train_data), "batches_committed": 0})
        self.optimizer = Optimizer(self.manager, optimizer)  # steps only if every group commits the step

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        loss = self.loss_fn(self.model(source), targets)
        loss.backward()
        for p in self.model.parameters():  # the mean over the step's groups; a failure skips the step
            self.manager.allreduce(p.grad).wait()  # (torchft's DDP wrapper: docs/fault-tolerance.md)
        self.manager.allreduce(loss := loss.detach()).wait()  # the mean over the step's groups, for the log
        self.optimizer.step()
        return loss.detach()

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)  # a new, seeded order: each process takes its share
        losses = []
        for source, targets in self.train_data:
            if (step := self.manager.current_step()) == (epoch + 1) * len(self.train_data):
                break  # the epoch's last step is committed: by the peer this group healed from
            source, targets = source.to(self.device), targets.to(self.device)
            while self.manager.current_step() == step:  # a step that did not commit is tried again
                losses.append(self._run_batch(source, targets))
        return torch.stack(losses).mean()

    def train(self):
        while (epoch := self.manager.current_step() // len(self.train_data)) < self.args.total_epochs:
            start = time.perf_counter()
            loss = self._run_epoch(epoch)
            if self.manager.current_step() == (epoch + 1) * len(self.train_data):  # each group logs and saves
                n = self.manager.num_participants()  # log_epoch takes a sum over the processes
                log_epoch(self.args, epoch + 1, loss * n, start, len(self.train_data.dataset), n)
                if (epoch + 1) % self.args.save_every == 0 or epoch + 1 == self.args.total_epochs:
                    save_snapshot(self.args.snapshot_path, self.model, self.optimizer, epoch + 1)
        if self.epochs_run < self.args.total_epochs:  # after nothing to train, nothing to report
            check_replicas(self.manager, self.model)


def main(args):
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    print(f"[group {args.replica_group}/{args.replica_groups}] {device}, gloo\n", end="", flush=True)  # whole
    train_set, model, optimizer, loss_fn = load_train_objs(args)
    sampler = DistributedSampler(train_set, args.replica_groups, args.replica_group, seed=args.seed)
    train_data = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    try:
        Trainer(model, train_data, optimizer, loss_fn, device, args).train()
    except (RuntimeError, TimeoutError) as exc:  # torchft's bounded waits: say what they waited for
        sys.exit(f"error: {exc!r}\nno quorum of {args.min_replicas} at {args.lighthouse}: {args.timeout:g} s")


# Below: the same in every step (tests/test_structure.py checks), so that the lesson above reads first.
def get_parser():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("total_epochs", type=int, help="epochs to train in all")
    parser.add_argument("save_every", type=int, help="write a snapshot every this many epochs")
    parser.add_argument("--batch_size", type=int, default=32, help="samples per step and process")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    parser.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (default 0, plain SGD)")
    parser.add_argument("--seed", type=int, default=0, help="seed for data, weights and shuffling")
    name = os.path.splitext(os.path.basename(sys.argv[0]))[0]
    parser.add_argument("--snapshot_path", default=f"{name}_snapshot.pt", help="resume from, save to")
    parser.add_argument("--metrics_path", help="append one JSON line per epoch to this file")
    parser.add_argument("--workload", choices=["tiny", "vision"], default="tiny", help="default: tiny")
    parser.add_argument("--data_dir", help="vision: an ImageFolder tree (class/image.png)")
    parser.add_argument("--dataset_size", type=int, default=2048, help="samples when generated")
    return parser


def check_args(parser, args):
    """Bad input ends here, before anything runs or is written: a message and exit status 2."""
    for name in ["total_epochs", "save_every", "batch_size", "lr", "dataset_size"]:
        if getattr(args, name) <= 0:
            parser.error(f"{name} must be positive, got {getattr(args, name)}")
    if not 0 <= args.momentum < 1:
        parser.error(f"momentum must be at least 0 and below 1, got {args.momentum}")
    folder = args.data_dir
    if folder and not (args.workload == "vision" and os.path.isdir(folder) and any(os.scandir(folder))):
        parser.error(f"--data_dir {folder}: needs --workload vision and class folders (class/image.png)")


def load_train_objs(args):
    """The dataset, the model, its optimizer and its loss function: the same in every process."""
    torch.manual_seed(args.seed)  # same data and initial weights in every process and every run
    if args.workload == "tiny":  # linear regression toward hidden weights: the loss falls fast
        hidden = torch.randn(20, 1)
        inputs = [torch.randn(20) for _ in range(args.dataset_size)]  # a tensor per sample, as from files
        train_set = [(x, x @ hidden + 0.01 * torch.randn(1)) for x in inputs]
        model, loss_fn = torch.nn.Linear(20, 1), F.mse_loss
    else:  # ResNet-18 on an ImageFolder tree, or on synthetic images: a pattern per class plus noise
        from torchvision import datasets, models, transforms

        if args.data_dir:
            to_tensor = transforms.Compose([transforms.Resize((32, 32)), transforms.ToTensor()])
            train_set = datasets.ImageFolder(args.data_dir, to_tensor)
        else:
            labels = torch.randint(10, (args.dataset_size,))
            images = torch.randn(10, 3, 32, 32)[labels] + torch.randn(args.dataset_size, 3, 32, 32)
            train_set = list(zip(images, labels, strict=True))
        classes = len(train_set.class_to_idx) if args.data_dir else 10
        model, loss_fn = models.resnet18(num_classes=classes), F.cross_entropy
    foreach = torch.cuda.is_available()  # torch's default (foreach on GPUs), set once, not every step
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, foreach=foreach)
    return train_set, model, optimizer, loss_fn


def save_snapshot(path, model, optimizer, epochs_run):
    """Write a temporary file, then rename it: a crash mid-write leaves the previous snapshot whole."""
    state = {"MODEL_STATE": model.state_dict(), "OPTIMIZER_STATE": optimizer.state_dict()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(tmp := f"{path}.tmp.{os.getpid()}", "wb") as f:
        torch.save({**state, "EPOCHS_RUN": epochs_run}, f)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename makes it the snapshot
    os.replace(tmp, path)


def load_snapshot(path, model, optimizer, device, total_epochs):
    """Restore model and optimizer from the snapshot, if there is one; return the epochs it holds."""
    if not os.path.exists(path):
        return 0
    first = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0  # speaks for all
    try:  # weights_only: tensors and plain containers only, a file that would run code is refused
        snapshot = torch.load(path, map_location=device, weights_only=True)
        model.load_state_dict(snapshot["MODEL_STATE"])
        optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        epochs_run = int(snapshot["EPOCHS_RUN"])
    except Exception as exc:  # garbage fails in many ways: the type and the whole reason (keys, shapes)
        message = f"error: cannot resume from snapshot {path} ({type(exc).__name__}: {str(exc).strip()})"
        sys.exit(f"{message}. It is left untouched: move it away." if first else 0)  # the others end quietly
    end = ", nothing to train: raise total_epochs to go on" if epochs_run >= total_epochs else ""
    if first:  # a finished run in the GPT trainer's words (examples/gpt/train.py); one line, not print's two
        print(f"resuming from {path}: {epochs_run} epochs already run{end}\n", end="", flush=True)
    return epochs_run


def log_epoch(args, epoch, loss, start, samples, world_size=1):
    loss, seconds = loss.item() / world_size, time.perf_counter() - start
    record = {"epoch": epoch, "loss": loss, "samples_per_s": samples / seconds, "world_size": world_size}
    speed = f"{samples / seconds:.0f} samples/s | {seconds:.2f} s | world_size {world_size}"
    print(f"epoch {epoch}/{args.total_epochs} | loss {loss:.6g} | {speed}", flush=True)
    if args.metrics_path:
        with open(args.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")


def check_replicas(manager, model):
    """DDP keeps the replicas identical: rank 0 counts the processes whose weights equal its own."""
    mine = torch.cat([p.detach().flatten() for p in model.parameters()])
    rank0 = mine * (manager.participating_rank() == 0)  # the first group's weights, zeros elsewhere
    manager.allreduce(rank0, reduce_op=dist.ReduceOp.SUM).wait()  # the sum: the first group's, everywhere
    same = torch.tensor(float(torch.equal(mine, rank0)))  # 1 or 0; summed, how many groups agree
    manager.allreduce(same, reduce_op=dist.ReduceOp.SUM).wait()
    if manager.participating_rank() == 0:
        print(f"weights identical on {same.item():.0f} of {manager.num_participants()} groups", flush=True)


if __name__ == "__main__":
    parser = get_parser()
    parser.add_argument("--timeout", type=float, default=120, help="seconds a process waits for the others")
    parser.add_argument("--replica_group", type=int, default=0, help="this group's number: 0, 1, ...")
    parser.add_argument("--replica_groups", type=int, default=2, help="groups the data is split between")
    parser.add_argument("--min_replicas", type=int, default=1, help="groups a step needs (default 1)")
    parser.add_argument("--lighthouse", default="http://localhost:29510", help="the lighthouse's address")
    check_args(parser, args := parser.parse_args())
    if not 0 <= args.replica_group < args.replica_groups or args.min_replicas < 1:
        parser.error("needs 0 <= --replica_group < --replica_groups and --min_replicas at least 1")
    if os.getenv("LOCAL_WORLD_SIZE") != "1":
        parser.error(f"a group is one process: torchrun --standalone --nproc-per-node=1 {sys.argv[0]} ...")
    os.environ["TORCHFT_LIGHTHOUSE"] = args.lighthouse
    main(args)
