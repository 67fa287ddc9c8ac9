"""recipe.py with Hugging Face Accelerate: Accelerator does what DDP's lines did.

accelerate launch --config_file accelerate/one_node.yaml recipe_accelerate.py 10 5
"""

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import sys
from datetime import timedelta

import numpy
import sklearn.datasets
import torch
import torch.distributed as dist
import torch.distributed.nn  # before any group forms, or the exit may abort
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

PRECISIONS = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}  # ours: accelerate's
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
    def __init__(self, model, train_data, val_data, optimizer, accelerator, args):
        self.accelerator, self.train_data, self.args = accelerator, train_data, args
        self.device = accelerator.device
        self.rank, self.world_size = accelerator.process_index, accelerator.num_processes
        self.steps_per_epoch = len(train_data) // args.grad_accum
        # prepare(): DDP around the model, autocast in its forward, validation shared out
        self.model, self.optimizer, self.val_data = accelerator.prepare(model, optimizer, val_data)
        # a step's size: a snapshot taken mid-epoch resumes on the same only
        self.layout = [self.world_size, args.batch_size, args.grad_accum]
        state = load_snapshot(args.snapshot_path, accelerator)
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
            self.accelerator.print(f"resuming from {args.snapshot_path}: {self._progress()}")
        unused = len(train_data) % args.grad_accum
        if unused:  # an epoch ends where a whole step does not fit
            self.accelerator.print(
                f"note: {unused} of each process's {len(train_data)} micro-batches go unused"
            )

    def _forward(self, source, targets, reduction="mean"):
        source, targets = source.to(self.device, non_blocking=True), targets.to(self.device)
        logits = self.model(source).float()
        return nn.functional.cross_entropy(logits, targets, reduction=reduction), logits, targets

    def _run_step(self, batches):
        loss = 0.0
        for source, targets in batches:
            # no_sync() but for the last micro-batch; step() and zero_grad() act only then
            with self.accelerator.accumulate(self.model):
                micro = self._forward(source, targets)[0]
                self.accelerator.backward(micro)  # divided by --grad_accum, scaled for fp16
                self.optimizer.step()
                self.optimizer.zero_grad()
            loss += micro.item() / len(batches)
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
            both = torch.tensor([loss, len(STOP)], dtype=torch.float64, device=self.device)
            both = self.accelerator.reduce(both, "sum")  # the loss, and whether any got a signal
            self.loss_sum += both[0].item()
            if both[1].item() > 0:
                return True

    def _validate(self):
        totals = torch.zeros(3, dtype=torch.float64)
        self.model.eval()
        with torch.no_grad(), signals_held():  # its workers start in the loop
            for batch in self.val_data:
                losses, logits, targets = self._forward(*batch, reduction="none")
                # every process's answers, less the repeats that evened out the last batches
                losses, right = self.accelerator.gather_for_metrics((losses, logits.argmax(1) == targets))
                totals += torch.tensor([losses.double().sum(), right.sum(), len(right)])
        self.model.train()
        loss, correct, count = totals[0].item() / totals[2].item(), int(totals[1]), int(totals[2])
        accuracy = f"{correct}/{count} ({100 * correct / count:.2f}%)"
        return loss, f"val_loss {loss:.6g} | val_acc {accuracy} | world_size {self.world_size}"

    def _save(self, path):
        self.accelerator.save_state(f"{path}.tmp")  # model, optimizer, scaler, random states
        self.accelerator.wait_for_everyone()  # every process's random state is in PATH.tmp before it moves
        if self.accelerator.is_main_process:
            state = {"epochs": self.epochs_run, "steps": self.steps_run, "layout": self.layout}
            state.update(best=self.best, loss_sum=self.loss_sum)
            with open(f"{path}.tmp/progress.json", "w") as file:
                json.dump(state, file)
            shutil.rmtree(path, ignore_errors=True)
            os.replace(f"{path}.tmp", path)  # a crash before this keeps PATH.tmp whole
        self.accelerator.wait_for_everyone()

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
        self.accelerator.print(f"{where} | {self._validate()[1]}")
        for epoch in range(self.epochs_run, total):
            stopping = self._run_epoch(epoch)
            if self.steps_run == self.steps_per_epoch:  # the epoch's end
                self.epochs_run, self.steps_run = epoch + 1, 0
                train_loss, self.loss_sum = self.loss_sum / (self.steps_per_epoch * self.world_size), 0.0
                loss, line = self._validate()
                self.accelerator.print(f"epoch {epoch + 1}/{total} | train_loss {train_loss:.6g} | {line}")
                if loss < self.best:  # kept beside the last snapshot
                    self.best = loss
                    self._save(path + "_best")
                if (epoch + 1) % self.args.save_every == 0 or epoch + 1 == total:
                    self._save(path)
            if stopping:
                self._save(path)
                why = (STOP or ["a signal to another process"])[0]
                saved = f"saved in {path}: the same command resumes, {self._progress()}"
                return self.accelerator.print(f"stopped by {why}, {saved}")


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
    # cpu=True without CUDA: gloo; mixed precision from --precision, else the config
    wait = InitProcessGroupKwargs(timeout=timedelta(seconds=args.timeout))
    precision = PRECISIONS.get(args.precision)
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),
        mixed_precision=precision,
        gradient_accumulation_steps=args.grad_accum,
        kwargs_handlers=[wait],
    )
    device = accelerator.device
    sys.stdout.write(f"[rank {dist.get_rank()}/{dist.get_world_size()}] {device}, {dist.get_backend()}\n")
    train_set, val_set, model, optimizer = load_train_objs(args)
    # not prepared: the DDP recipe's order (prepare() would deal out whole batches)
    sampler = DistributedSampler(train_set, seed=args.seed, drop_last=True)
    pin = device.type == "cuda"  # pinned memory: a faster copy to the GPU
    loading = {"num_workers": args.workers, "pin_memory": pin}
    train_data = DataLoader(train_set, args.batch_size, sampler=sampler, drop_last=True, **loading)
    val_data = DataLoader(val_set, args.batch_size, **loading)  # shared out by prepare()
    if len(train_data) < args.grad_accum:
        refuse(f"batch_size x grad_accum exceeds a process's {len(sampler)} training images")
    Trainer(model, train_data, val_data, optimizer, accelerator, args).train()
    accelerator.end_training()


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
    parser.add_argument("--precision", choices=PRECISIONS, help="default: the config's")
    parser.add_argument("--workers", type=int, default=2, help="loader processes a rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--snapshot_path", default="recipe_accelerate_snapshot", help="a folder")
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


def load_snapshot(path, accelerator):
    if not os.path.exists(path) and os.path.exists(f"{path}.tmp/progress.json"):  # whole, not moved in
        accelerator.wait_for_everyone()  # every process has looked
        if accelerator.is_main_process:
            os.replace(f"{path}.tmp", path)
        accelerator.wait_for_everyone()
    if not os.path.exists(path):
        return {"epochs": 0, "steps": 0, "best": math.inf, "loss_sum": 0.0, "layout": None}
    try:
        accelerator.load_state(path)  # into the prepared model, optimizer and scaler
        with open(os.path.join(path, "progress.json")) as file:
            state = json.load(file)
    except Exception as exc:
        refuse(f"error: cannot resume from {path}: {exc!r}. Move it away to start again.")
    return state


if __name__ == "__main__":
    try:
        main()
    except argparse.ArgumentError as exc:
        if "TORCHELASTIC_ERROR_FILE" not in os.environ:
            print(exc, file=sys.stderr)  # no torchrun summary to show it (under mpirun, say)
        sys.exit(2)
