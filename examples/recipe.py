"""After step 3: the DDP script to copy into a project, on a real data set (scikit-learn's digits).

torchrun --standalone --nproc-per-node=2 recipe.py 10 5 [--precision fp32 --grad_accum 4 --compile ...]
"""

import argparse
import contextlib
import difflib
import functools
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
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
STOP = []  # the signals this process got
NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C"}


class Augmented(TensorDataset):  # training images, shifted by up to a pixel and noised
    seed, epoch = 0, 0  # set before each epoch, read in every loader worker

    def __getitem__(self, index):
        image, label = super().__getitem__(index)
        random = numpy.random.default_rng([self.seed, self.epoch, index])  # whatever the processes
        dy, dx = random.integers(0, 3, size=2)
        image = nn.functional.pad(image, (1, 1, 1, 1))[:, dy : dy + 8, dx : dx + 8]
        return image + torch.tensor(random.normal(0, 0.1, image.shape), dtype=torch.float32), label


@contextlib.contextmanager
def signals_held():  # loader workers started meanwhile never get them: the rank acts on them
    signal.pthread_sigmask(signal.SIG_BLOCK, NAMES)
    yield
    signal.pthread_sigmask(signal.SIG_UNBLOCK, NAMES)


class Parser(argparse.ArgumentParser):
    def error(self, message):
        if message.startswith("unrecognized arguments: "):  # a typo: the nearest option
            near = difflib.get_close_matches(message.split()[2].split("=")[0], self._option_string_actions)
            message += f" (did you mean {near[0]}?)" if near else ""
        if "LOCAL_RANK" not in os.environ:
            super().error(message)  # python alone: argparse's usage line and message
        refuse(message)  # under torchrun: said once, in torchrun's summary


def lr_factor(step, warmup, total):  # of --lr: a linear warm-up, then a cosine down to a tenth
    done = min(1.0, max(0, step - warmup) / max(1, total - warmup))
    return min(1.0, (step + 1) / max(1, warmup)) * (0.55 + 0.45 * math.cos(math.pi * done))


class Trainer:
    def __init__(self, model, train_set, val_set, optimizer, device, args):
        self.train_set, self.optimizer, self.device, self.args = train_set, optimizer, device, args
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dtype = DTYPES[args.precision]
        self.scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")  # no underflow
        self.sampler = DistributedSampler(train_set, seed=args.seed, drop_last=True)
        self.loading = {"num_workers": args.workers, "pin_memory": device.type == "cuda"}  # pinned: faster
        share = Subset(val_set, range(self.rank, len(val_set), self.world_size))  # none twice: exact sums
        self.val_data = DataLoader(share, args.batch_size, **self.loading)
        batches = len(self.sampler) // args.batch_size
        if batches < args.grad_accum:
            refuse(f"batch_size x grad_accum exceeds a process's {len(self.sampler)} training images")
        self.steps_per_epoch, unused = divmod(batches, args.grad_accum)
        if unused:  # an epoch ends where a whole step does not fit
            self._print(f"note: {unused} of each process's {batches} micro-batches go unused")
        total = self.steps_per_epoch * args.total_epochs
        self.scheduler = LambdaLR(optimizer, functools.partial(lr_factor, warmup=args.warmup, total=total))
        self.layout = [self.world_size, args.batch_size, args.grad_accum]  # a step's size
        state = load_snapshot(args.snapshot_path, model, optimizer, self.scaler, self.scheduler, device)
        if state["steps"] and state["layout"] != self.layout:
            said = f"{state['layout']}, not {self.layout} (processes, batch_size, grad_accum)"
            refuse(f"error: {args.snapshot_path} stopped mid-epoch on {said}: resume it so, or move it away")
        self.epochs_run, self.steps_run = state["epochs"], state["steps"]  # and steps of the next epoch
        self.best, self.loss_sum = state["best"], state["loss_sum"]
        if state["epochs"] or state["steps"]:
            self._print(f"resuming from {args.snapshot_path}: {self._progress()}")
        self.net = model  # the snapshot's names, compiled or not
        self.model = DDP(torch.compile(model) if args.compile else model)

    def _forward(self, model, source, targets, reduction="mean"):
        source, targets = source.to(self.device, non_blocking=True), targets.to(self.device)
        with torch.autocast(self.device.type, self.dtype, enabled=self.dtype != torch.float32):
            logits = model(source).float()
        return nn.functional.cross_entropy(logits, targets, reduction=reduction), logits, targets

    def _run_step(self, batches):
        loss = 0.0
        for i, (source, targets) in enumerate(batches):
            # gradients add up; the last backward all-reduces them
            with self.model.no_sync() if i < len(batches) - 1 else contextlib.nullcontext():
                micro = self._forward(self.model, source, targets)[0] / len(batches)
                self.scaler.scale(micro).backward()
            loss += micro.detach()  # a tensor: read here, it would wait for the GPU
        if self.args.clip:
            self.scaler.unscale_(self.optimizer)  # fp16's gradients are scaled: clip the true ones
            nn.utils.clip_grad_norm_(self.model.parameters(), self.args.clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad()
        return loss

    def _run_epoch(self, epoch):
        self.sampler.set_epoch(epoch)  # the order, alike in every process
        self.train_set.epoch = epoch  # the augmentations
        done = self.steps_run * self.args.grad_accum * self.args.batch_size
        todo = list(self.sampler)[done:]  # after a stop, the rest of the epoch: nothing read twice
        with signals_held():  # its workers start
            batches = iter(DataLoader(self.train_set, self.args.batch_size, sampler=todo, **self.loading))
        losses, steps = torch.zeros((), device=self.device), 0  # since the last log line
        for _ in range(self.steps_run, self.steps_per_epoch):
            losses += self._run_step([next(batches) for _ in range(self.args.grad_accum)])
            self.steps_run, steps = self.steps_run + 1, steps + 1
            if self.steps_run % self.args.log_every and self.steps_run < self.steps_per_epoch:
                continue  # no host read between log lines: the GPU runs ahead
            both = torch.stack([losses.double(), torch.tensor(len(STOP), device=self.device).double()])
            dist.all_reduce(both)  # the losses, and whether any process got a signal
            self.loss_sum += both[0].item()
            loss, lr = both[0].item() / (steps * self.world_size), self.scheduler.get_last_lr()[0]
            at = f"step {self.steps_run}/{self.steps_per_epoch} of epoch {epoch + 1}"
            self._print(f"{at} | loss {loss:.6g} | lr {lr:.3g}")
            losses, steps = torch.zeros_like(losses), 0
            if self.args.save_steps and self.steps_run % self.args.save_steps == 0:
                self._save(self.args.snapshot_path)
            if both[1].item() > 0:
                return True

    def _validate(self):
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)
        model = self.model.module.eval()  # not DDP's forward: the processes hold different counts
        with torch.no_grad(), signals_held():  # its workers start in the loop
            for batch in self.val_data:
                losses, logits, targets = self._forward(model, *batch, reduction="none")
                totals[0] += losses.double().sum()
                totals[1] += (logits.argmax(1) == targets).sum()
                totals[2] += len(targets)
        model.train()
        dist.all_reduce(totals)  # sums, not means: exact at any world size
        loss, correct, count = totals[0].item() / totals[2].item(), int(totals[1]), int(totals[2])
        accuracy = f"{correct}/{count} ({100 * correct / count:.2f}%)"
        return loss, f"val_loss {loss:.6g} | val_acc {accuracy} | world_size {self.world_size}"

    def _save(self, path):
        state = {"epochs": self.epochs_run, "steps": self.steps_run, "layout": self.layout}
        state.update(best=self.best, loss_sum=self.loss_sum)
        if self.rank == 0:
            save_snapshot(path, self.net, self.optimizer, self.scaler, self.scheduler, state)

    def _progress(self):
        steps = f", and {self.steps_run} steps of epoch {self.epochs_run + 1}" if self.steps_run else ""
        return f"{self.epochs_run} epochs already run{steps}"

    def train(self):
        path, total = self.args.snapshot_path, self.args.total_epochs
        where = "nothing to train" if self.epochs_run >= total else f"before epoch {self.epochs_run + 1}"
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
                said = f"saved in {path}: the same command resumes, {self._progress()}"
                return self._print(f"stopped by {why}, {said}")

    def _print(self, line):
        if self.rank == 0:  # one process logs and saves for all
            print(line, flush=True)


@record  # torchrun's summary shows this function's error, from its error file
def main():
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=120, help="seconds to wait for others")
    args = get_args(parser)  # python alone: --help, or argparse's own usage and error
    if "LOCAL_RANK" not in os.environ:
        parser.error(f"start me with torchrun --standalone --nproc-per-node=2 {sys.argv[0]} ...")
    for signum in NAMES:  # noted; acted on at the next log line
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
    Trainer(model, train_set, val_set, optimizer, device, args).train()
    dist.destroy_process_group()


def refuse(message):
    if dist.is_initialized():
        dist.destroy_process_group()
    if os.environ.get("LOCAL_RANK", "0") != "0":
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
    parser.add_argument("--warmup", type=int, default=10, help="steps of rising learning rate")
    parser.add_argument("--clip", type=float, default=1.0, help="largest gradient norm (0: none)")
    parser.add_argument("--log_every", type=int, default=10, help="steps between log lines")
    parser.add_argument("--save_steps", type=int, default=0, help="steps between snapshots too")
    parser.add_argument("--compile", action="store_true", help="the model through torch.compile")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--snapshot_path", default="recipe_snapshot.pt", help="and its _best.pt")
    args = parser.parse_args()
    for key in ["total_epochs", "save_every", "batch_size", "grad_accum", "lr", "timeout", "log_every"]:
        if not 0 < getattr(args, key) < math.inf:
            parser.error(f"{key} must be positive and finite, got {getattr(args, key)}")
    for key in ["workers", "seed", "warmup", "clip", "save_steps"]:
        if not 0 <= getattr(args, key) < math.inf:
            parser.error(f"{key} must be 0 or more, got {getattr(args, key)}")
    if args.save_steps % args.log_every:  # a snapshot holds the losses summed at a log line
        parser.error(f"save_steps must be a multiple of log_every ({args.log_every})")
    folder = os.path.dirname(args.snapshot_path) or "."  # now, not at the first save
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        parser.error(f"snapshot_path: no folder {folder} to write in; create it or give another")
    return args


def load_train_objs(args):
    """The same in every process: the digits split by the seed, a small CNN, AdamW."""
    pixels, digits = sklearn.datasets.load_digits(return_X_y=True)  # shipped with scikit-learn
    images, labels = torch.tensor(pixels, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16, torch.tensor(digits)
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


def save_snapshot(path, model, optimizer, scaler, scheduler, state):
    state = {"MODEL_STATE": model.state_dict(), "OPTIMIZER_STATE": optimizer.state_dict(), "STATE": state}
    state.update(SCALER_STATE=scaler.state_dict(), SCHEDULER_STATE=scheduler.state_dict())
    torch.save(state, f"{path}.tmp.{os.getpid()}")
    os.replace(f"{path}.tmp.{os.getpid()}", path)  # atomic: a crash leaves the old one whole


def load_snapshot(path, model, optimizer, scaler, scheduler, device):
    model.to(device)  # first: the optimizer's state goes where its parameters are
    if not os.path.exists(path):
        return {"epochs": 0, "steps": 0, "best": math.inf, "loss_sum": 0.0, "layout": None}
    try:
        snapshot = torch.load(path, map_location=device, weights_only=True)  # data only, no code
        model.load_state_dict(snapshot["MODEL_STATE"])
        optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        scaler.load_state_dict(snapshot["SCALER_STATE"])
        scheduler.load_state_dict(snapshot["SCHEDULER_STATE"])
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
