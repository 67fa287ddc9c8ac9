"""After step 3: the DDP script to copy into a project, on a real data set (scikit-learn's digits).

torchrun --standalone --nproc-per-node=2 recipe.py 10 5 [--precision fp32 --grad_accum 4 ...]
"""

import argparse
import contextlib
import math
import os
import signal
import sys
from datetime import timedelta

import numpy
import sklearn.datasets
import torch
import torch.distributed as dist
import torch.distributed.nn  # before any group forms, or the exit may abort
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
STOP = []  # the signals this process got
NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C"}


class Augmented(TensorDataset):  # training images, shifted by up to a pixel and noised
    seed, epoch = 0, 0  # set before each epoch, read in every loader worker

    def __getitem__(self, index):
        image, label = super().__getitem__(index)
        # its own random numbers in this epoch, whatever the processes and workers
        random = numpy.random.default_rng([self.seed, self.epoch, index])
        dy, dx = random.integers(0, 3, size=2)
        image = nn.functional.pad(image, (1, 1, 1, 1))[:, dy : dy + 8, dx : dx + 8]
        return image + torch.tensor(random.normal(0, 0.1, image.shape), dtype=torch.float32), label


@contextlib.contextmanager
def signals_held():  # loader workers started meanwhile never get them: the rank acts on them
    signal.pthread_sigmask(signal.SIG_BLOCK, NAMES)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, NAMES)


class Trainer:
    def __init__(self, model, train_data, val_data, optimizer, device, args):
        self.train_data, self.val_data = train_data, val_data
        self.optimizer, self.device, self.args = optimizer, device, args
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")  # no underflow
        self.dtype = DTYPES[args.precision]
        self.steps_per_epoch = len(train_data) // args.grad_accum
        # a step's size: a snapshot taken mid-epoch resumes on the same only
        self.layout = [self.world_size, args.batch_size, args.grad_accum]
        state = load_snapshot(args.snapshot_path, model, optimizer, self.scaler, device)
        if state["steps"] and state["layout"] != self.layout:
            was, now = (" x ".join(map(str, layout)) for layout in (state["layout"], self.layout))
            refuse(
                f"error: {args.snapshot_path} stopped mid-epoch on {was} (processes x batch_size x "
                f"grad_accum), not {now}: resume it so, or move it away to start again"
            )
        # epochs done, steps done of the next, best val loss, this epoch's summed loss
        self.epochs_run, self.steps_run = state["epochs"], state["steps"]
        self.best, self.loss_sum = state["best"], state["loss_sum"]
        if state["epochs"] or state["steps"]:
            self._print(f"resuming from {args.snapshot_path}: {self._progress()}")
        unused = len(train_data) % args.grad_accum
        if unused:  # an epoch ends where a whole step does not fit
            self._print(f"note: {unused} of each process's {len(train_data)} micro-batches go unused")
        self.model = DDP(model)

    def _forward(self, source, targets, reduction="mean"):
        source, targets = source.to(self.device, non_blocking=True), targets.to(self.device)
        with torch.autocast(self.device.type, self.dtype, enabled=self.dtype != torch.float32):
            logits = self.model(source).float()
        return nn.functional.cross_entropy(logits, targets, reduction=reduction), logits, targets

    def _backward(self, source, targets, parts):
        loss = self._forward(source, targets)[0] / parts
        self.scaler.scale(loss).backward()
        return loss.detach()  # a tensor: read here, it would wait for the GPU

    def _run_step(self, batches):
        loss = 0.0
        with self.model.no_sync():  # gradients add up here; the last backward all-reduces them
            for source, targets in batches[:-1]:
                loss += self._backward(source, targets, len(batches))
        loss += self._backward(*batches[-1], len(batches))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad()
        return loss

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)  # the order, alike in every process
        self.train_data.dataset.epoch = epoch  # the augmentations
        with signals_held():
            batches = iter(self.train_data)  # its workers start
        for step in range(self.steps_per_epoch):
            micro = [next(batches) for _ in range(self.args.grad_accum)]
            if step < self.steps_run:
                continue  # done before a stop
            loss = self._run_step(micro)
            self.steps_run += 1
            stop = torch.tensor(len(STOP), dtype=torch.float64, device=self.device)
            both = torch.stack([loss.double(), stop])
            dist.all_reduce(both)  # one a step: the loss, and whether any process got a signal
            self.loss_sum += both[0].item()
            if both[1].item() > 0:
                return True

    def _validate(self):
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)
        # the sampler repeats samples so that every rank has as many: this rank's k-th
        # sample is the (rank + k * world_size)-th of the list, a repeat past the end
        places = torch.arange(len(self.val_data.sampler), device=self.device) * self.world_size
        reals = (self.rank + places < len(self.val_data.dataset)).split(self.args.batch_size)
        self.model.eval()
        with torch.no_grad(), signals_held():  # its workers start in the loop
            for batch, real in zip(self.val_data, reals, strict=True):
                losses, logits, targets = self._forward(*batch, reduction="none")
                totals[0] += losses[real].double().sum()
                totals[1] += (logits.argmax(1) == targets)[real].sum()
                totals[2] += real.sum()
        self.model.train()
        dist.all_reduce(totals)  # sums, not means: exact at any world size
        loss, correct, count = totals[0].item() / totals[2].item(), int(totals[1]), int(totals[2])
        accuracy = f"{correct}/{count} ({100 * correct / count:.2f}%)"
        return loss, f"val_loss {loss:.6g} | val_acc {accuracy} | world_size {self.world_size}"

    def _save(self, path):
        if self.rank == 0:
            state = {"epochs": self.epochs_run, "steps": self.steps_run, "layout": self.layout}
            state.update(best=self.best, loss_sum=self.loss_sum)
            save_snapshot(path, self.model.module, self.optimizer, self.scaler, state)

    def _progress(self):
        done = f"{self.epochs_run} epochs already run"
        return done + (
            f", and {self.steps_run} steps of epoch {self.epochs_run + 1}" if self.steps_run else ""
        )

    def train(self):
        path, total = self.args.snapshot_path, self.args.total_epochs
        where = f"before epoch {self.epochs_run + 1}"
        if self.epochs_run >= total:
            where = "nothing to train"
        self._print(f"{where} | {self._validate()[1]}")
        for epoch in range(self.epochs_run, total):
            stopping = self._run_epoch(epoch)
            if self.steps_run == self.steps_per_epoch:  # the epoch's end
                self.epochs_run, self.steps_run = epoch + 1, 0
                train_loss, self.loss_sum = self.loss_sum / (self.steps_per_epoch * self.world_size), 0.0
                loss, line = self._validate()
                self._print(f"epoch {epoch + 1}/{total} | train_loss {train_loss:.6g} | {line}")
                if loss < self.best:  # kept beside the last snapshot
                    self.best = loss
                    self._save(path.removesuffix(".pt") + "_best.pt")
                if (epoch + 1) % self.args.save_every == 0 or epoch + 1 == total:
                    self._save(path)
            if stopping:
                self._save(path)
                why = (STOP or ["a signal to another process"])[0]
                return self._print(
                    f"stopped by {why}, saved in {path}: the same command resumes, {self._progress()}"
                )

    def _print(self, line):
        if self.rank == 0:  # one process logs and saves for all
            print(line, flush=True)


@record  # torchrun's summary shows this function's error, from its error file
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=120, help="seconds to wait for others")
    if "LOCAL_RANK" in os.environ:
        parser.error = refuse  # said once, by local rank 0
    args = get_args(parser)  # python alone: --help, or argparse's own usage and error
    if "LOCAL_RANK" not in os.environ:
        parser.error(f"start me with torchrun --standalone --nproc-per-node=2 {sys.argv[0]} ...")
    for signum in NAMES:  # noted; acted on at the next step
        signal.signal(signum, lambda signum, frame: STOP.append(NAMES[signum]))
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        torch.cuda.set_device(device)
    if args.precision is None:  # bf16, but fp16 on a GPU before Ampere
        old_gpu = torch.cuda.is_available() and not torch.cuda.is_bf16_supported(including_emulation=False)
        args.precision = "fp16" if old_gpu else "bf16"
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    sys.stdout.write(f"[rank {dist.get_rank()}/{dist.get_world_size()}] {device}, {dist.get_backend()}\n")
    train_set, val_set, model, optimizer = load_train_objs(args)
    sampler = DistributedSampler(train_set, seed=args.seed, drop_last=True)
    pin = device.type == "cuda"  # pinned memory: a faster copy to the GPU
    loading = {"num_workers": args.workers, "pin_memory": pin}
    train_data = DataLoader(train_set, args.batch_size, sampler=sampler, drop_last=True, **loading)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    val_data = DataLoader(val_set, args.batch_size, sampler=val_sampler, **loading)
    if len(train_data) < args.grad_accum:
        refuse(f"batch_size x grad_accum exceeds a process's {len(sampler)} training images")
    Trainer(model, train_data, val_data, optimizer, device, args).train()
    dist.destroy_process_group()


def refuse(message):
    if dist.is_initialized():
        dist.destroy_process_group()
    if os.environ["LOCAL_RANK"] != "0":
        sys.exit(0)  # every process meets it alike: local rank 0 says why, the others end quietly
    raise argparse.ArgumentError(None, message) from None  # for @record, then __main__


def get_args(parser):
    parser.add_argument("total_epochs", type=int, help="epochs to train in all")
    parser.add_argument("save_every", type=int, help="epochs between snapshots")
    parser.add_argument("--batch_size", type=int, default=32, help="per process and micro-batch")
    parser.add_argument("--grad_accum", type=int, default=1, help="micro-batches a step")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--precision", choices=DTYPES, help="default: bf16 (fp16 before Ampere)")
    parser.add_argument("--workers", type=int, default=2, help="loader processes a rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--snapshot_path", default="recipe_snapshot.pt", help="and its _best.pt")
    args = parser.parse_args()
    for key in ["total_epochs", "save_every", "batch_size", "grad_accum", "lr", "timeout"]:
        if not 0 < getattr(args, key) < math.inf:
            parser.error(f"{key} must be positive and finite, got {getattr(args, key)}")
    for key in ["workers", "seed"]:
        if getattr(args, key) < 0:
            parser.error(f"{key} must be 0 or more, got {getattr(args, key)}")
    folder = os.path.dirname(args.snapshot_path) or "."  # now, not at the first save
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        parser.error(f"snapshot_path: no folder {folder} to write in; create it or give another")
    return args


def load_train_objs(args):
    """The same in every process: the digits split by the seed, a small CNN, AdamW."""
    pixels, digits = sklearn.datasets.load_digits(return_X_y=True)  # shipped with scikit-learn
    images = torch.tensor(pixels, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16
    labels = torch.tensor(digits)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(args.seed))
    val, train = order[:359], order[359:]  # of the 1,797 images
    train_set, val_set = Augmented(images[train], labels[train]), TensorDataset(images[val], labels[val])
    train_set.seed = args.seed
    torch.manual_seed(args.seed)
    layers = [nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
    layers += [nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Flatten()]
    model = nn.Sequential(*layers, nn.Linear(32 * 4 * 4, 10))
    optimizer = torch.optim.AdamW(model.parameters(), args.lr, foreach=True)
    return train_set, val_set, model, optimizer


def save_snapshot(path, model, optimizer, scaler, state):
    state = {"MODEL_STATE": model.state_dict(), "OPTIMIZER_STATE": optimizer.state_dict(), "STATE": state}
    torch.save({**state, "SCALER_STATE": scaler.state_dict()}, f"{path}.tmp.{os.getpid()}")
    os.replace(f"{path}.tmp.{os.getpid()}", path)  # atomic: a crash leaves the old one whole


def load_snapshot(path, model, optimizer, scaler, device):
    model.to(device)  # first: the optimizer's state goes where its parameters are
    if not os.path.exists(path):
        return {"epochs": 0, "steps": 0, "best": math.inf, "loss_sum": 0.0, "layout": None}
    try:
        snapshot = torch.load(path, map_location=device, weights_only=True)  # data only, no code
        model.load_state_dict(snapshot["MODEL_STATE"])
        optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        scaler.load_state_dict(snapshot["SCALER_STATE"])
    except Exception as exc:
        refuse(f"error: cannot resume from {path}: {exc!r}. Move it away to start again.")
    return snapshot["STATE"]


if __name__ == "__main__":
    try:
        main()
    except argparse.ArgumentError as exc:
        if "TORCHELASTIC_ERROR_FILE" not in os.environ:
            print(exc, file=sys.stderr)  # no torchrun summary to show it (under mpirun, say)
        sys.exit(2)
