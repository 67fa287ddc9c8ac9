"""Step 3: the same DDP training, started by torchrun, which also restarts processes that fail.

torchrun --standalone --nproc-per-node=2 multigpu_torchrun.py 10 5
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node=2 --max-restarts=3 \
    multigpu_torchrun.py 10 5    # a failed process restarts them all: they resume from the snapshot
"""

import argparse
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn  # before any group: imported later (by DDP) it pins the group and exit aborts
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def ddp_setup(local_rank, timeout):
    """Join the process group: torchrun put the rank, the world size and the rendezvous in the environment."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)  # one GPU per process: the current device from here on
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))  # bounds the wait for the others


class Trainer:
    def __init__(self, model, train_data, optimizer, loss_fn, device, args):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()  # this process, all of them
        self.device, self.model = device, model.to(device)
        self.train_data, self.optimizer, self.loss_fn, self.args = train_data, optimizer, loss_fn, args
        self.epochs_run = load_snapshot(args.snapshot_path, self.model, optimizer, device, args.total_epochs)
        # DDP: every process starts from rank 0's weights, and backward() averages the gradients
        self.model = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None)

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        loss = self.loss_fn(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)  # a new, seeded order: each process takes its share
        losses = []
        for source, targets in self.train_data:
            source, targets = source.to(self.device), targets.to(self.device)
            losses.append(self._run_batch(source, targets))
        return torch.stack(losses).mean()

    def train(self):
        for epoch in range(self.epochs_run, self.args.total_epochs):
            start = time.perf_counter()
            loss = self._run_epoch(epoch)
            dist.all_reduce(loss)  # the sum of every process's mean loss
            if self.rank == 0:  # one process logs and saves for all
                log_epoch(self.args, epoch + 1, loss, start, len(self.train_data.dataset), self.world_size)
                if (epoch + 1) % self.args.save_every == 0 or epoch + 1 == self.args.total_epochs:
                    save_snapshot(self.args.snapshot_path, self.model.module, self.optimizer, epoch + 1)
        check_replicas(self.model.module, self.epochs_run < self.args.total_epochs)


def main(args):
    ddp_setup(int(os.environ["LOCAL_RANK"]), args.timeout)  # torchrun numbers the processes on this machine
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    rank = f"[rank {dist.get_rank()}/{dist.get_world_size()}]"
    print(f"{rank} {device}, {dist.get_backend()}\n", end="", flush=True)  # one write: the line stays whole
    train_set, model, optimizer, loss_fn = load_train_objs(args)
    sampler = DistributedSampler(train_set, seed=args.seed)  # each process: every world_size-th sample
    train_data = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    Trainer(model, train_data, optimizer, loss_fn, device, args).train()
    dist.destroy_process_group()  # a group still pinned (see imports): exit aborts, docs/troubleshooting.md


def refuse(message):  # under torchrun: said once, in its closing summary (the error file), rank 0 last
    if not isinstance(message, str) or not os.getenv("TORCHELASTIC_ERROR_FILE"):  # a status, or no torchrun
        sys.exit(message)
    with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:  # as torch.distributed.elastic's @record does
        json.dump({"message": {"message": message, "extraInfo": {"timestamp": int(time.time())}}}, f)
    sys.exit(0 if os.environ["LOCAL_RANK"] != "0" else time.sleep(3) or 2)  # the others end first, quietly


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


def check_replicas(model, trained):
    """DDP keeps the replicas identical: rank 0 counts the processes whose weights equal its own."""
    mine = torch.cat([p.detach().flatten() for p in model.parameters()])
    dist.broadcast(rank0 := mine.clone(), src=0)
    dist.reduce(same := torch.tensor(float(torch.equal(mine, rank0)), device=mine.device), dst=0)  # 1 or 0
    if dist.get_rank() == 0 and trained:  # after nothing to train, nothing to report
        print(f"weights identical on {same.item():.0f} of {dist.get_world_size()} ranks", flush=True)


if __name__ == "__main__":
    parser = get_parser()
    parser.add_argument("--timeout", type=float, default=120, help="seconds a process waits for the others")
    if os.getenv("TORCHELASTIC_ERROR_FILE"):  # started by torchrun: an error is said once, in its summary
        parser.error = lambda message: refuse(f"error: {message}")
    check_args(parser, args := parser.parse_args())
    if "LOCAL_RANK" not in os.environ:
        parser.error(f"start me with torchrun: torchrun --standalone --nproc-per-node=2 {sys.argv[0]} ...")
    if os.getenv("TORCHELASTIC_USE_AGENT_STORE") == "True" and os.getenv("TORCHELASTIC_MAX_RESTARTS") != "0":
        parser.error("restarts need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone ...")
    if torch.cuda.device_count() and int(os.environ["LOCAL_WORLD_SIZE"]) > torch.cuda.device_count():
        parser.error(f"--nproc-per-node must be at most the number of GPUs ({torch.cuda.device_count()})")
    try:
        main(args)
    except SystemExit as exc:  # a refusal once the group is up (rank 0's, a snapshot that does not fit)
        dist.destroy_process_group()  # first: exit with the group's threads running can abort
        refuse(exc.code)  # the other processes: 0, they end quietly
