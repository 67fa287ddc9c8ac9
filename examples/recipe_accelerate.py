"""recipe.py in Hugging Face Accelerate's idiom: Accelerator does what DDP's lines did.

accelerate launch --config_file accelerate/one_node.yaml recipe_accelerate.py 10 5
"""

import argparse
import contextlib
import difflib
import functools
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
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, set_seed
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, TensorDataset

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
    def __init__(self, model, train_data, val_data, optimizer, accelerator, args):
        self.accelerator, self.args = accelerator, args
        self.train_set, self.world_size = train_data.dataset, accelerator.num_processes
        batches = len(train_data) // self.world_size  # before prepare(): every process's
        if batches < args.grad_accum:
            refuse(f"batch_size x grad_accum exceeds a process's {batches * args.batch_size} training images")
        self.steps_per_epoch, unused = divmod(batches, args.grad_accum)
        if unused:  # an epoch ends where a whole step does not fit
            accelerator.print(f"note: {unused} of each process's {batches} micro-batches go unused")
        # in one process's steps, as accelerate counts them: the prepared one steps once a process
        total = len(train_data) // args.grad_accum * args.total_epochs
        scheduler = LambdaLR(optimizer, functools.partial(lr_factor, warmup=args.warmup, total=total))
        # DDP around the model, autocast in its forward, the batches dealt out, the scheduler in step
        prepared = accelerator.prepare(model, optimizer, train_data, val_data, scheduler)
        self.model, self.optimizer, self.train_data, self.val_data, self.scheduler = prepared
        self.layout = [self.world_size, args.batch_size, args.grad_accum]  # a step's size
        state = load_snapshot(args.snapshot_path, accelerator)
        if state["steps"] and state["layout"] != self.layout:
            said = f"{state['layout']}, not {self.layout} (processes, batch_size, grad_accum)"
            refuse(f"error: {args.snapshot_path} stopped mid-epoch on {said}: resume it so, or move it away")
        self.epochs_run, self.steps_run = state["epochs"], state["steps"]  # and steps of the next epoch
        self.best, self.loss_sum = state["best"], state["loss_sum"]
        if state["epochs"] or state["steps"]:
            accelerator.print(f"resuming from {args.snapshot_path}: {self._progress()}")

    def _forward(self, source, targets, reduction="mean"):
        logits = self.model(source).float()  # on the device already
        return nn.functional.cross_entropy(logits, targets, reduction=reduction), logits, targets

    def _run_step(self, batches):
        loss = 0.0
        for source, targets in batches:
            # no_sync() but for the last micro-batch; step() and zero_grad() act only then
            with self.accelerator.accumulate(self.model):
                micro = self._forward(source, targets)[0]
                self.accelerator.backward(micro)  # divided by --grad_accum, scaled for fp16
                if self.args.clip and self.accelerator.sync_gradients:  # unscaled first
                    self.accelerator.clip_grad_norm_(self.model.parameters(), self.args.clip)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad()
            loss += micro.detach() / len(batches)  # a tensor: read here, it would wait for the GPU
        return loss

    def _run_epoch(self, epoch):
        self.train_set.epoch = epoch  # the augmentations
        done = self.steps_run * self.args.grad_accum
        data = self.accelerator.skip_first_batches(self.train_data, done)  # not read again after a stop
        data.set_epoch(epoch)  # the order, alike in every process
        batches = iter(data)
        losses, steps = torch.zeros((), device=self.accelerator.device), 0  # since the last log line
        for _ in range(self.steps_run, self.steps_per_epoch):
            with signals_held():  # the loader's workers start at its first batch
                micro = [next(batches) for _ in range(self.args.grad_accum)]
            losses += self._run_step(micro)
            self.steps_run, steps = self.steps_run + 1, steps + 1
            if self.steps_run % self.args.log_every and self.steps_run < self.steps_per_epoch:
                continue  # no host read between log lines: the GPU runs ahead
            both = torch.stack([losses.double(), torch.tensor(len(STOP), device=losses.device).double()])
            both = self.accelerator.reduce(both, "sum")  # the losses, and whether any got a signal
            self.loss_sum += both[0].item()
            loss, lr = both[0].item() / (steps * self.world_size), self.scheduler.get_last_lr()[0]
            at = f"step {self.steps_run}/{self.steps_per_epoch} of epoch {epoch + 1}"
            self.accelerator.print(f"{at} | loss {loss:.6g} | lr {lr:.3g}")
            losses, steps = torch.zeros_like(losses), 0
            if self.args.save_steps and self.steps_run % self.args.save_steps == 0:
                self._save(self.args.snapshot_path)
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
        self.accelerator.save_state(f"{path}.tmp")  # model, optimizer, scheduler, scaler, random states
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
        steps = f", and {self.steps_run} steps of epoch {self.epochs_run + 1}" if self.steps_run else ""
        return f"{self.epochs_run} epochs already run{steps}"

    def train(self):
        path, total = self.args.snapshot_path, self.args.total_epochs
        where = "nothing to train" if self.epochs_run >= total else f"before epoch {self.epochs_run + 1}"
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
                said = f"saved in {path}: the same command resumes, {self._progress()}"
                return self.accelerator.print(f"stopped by {why}, {said}")


@record  # torchrun's summary shows this function's error, from its error file
def main():
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=120, help="seconds to wait for others")
    args = get_args(parser)  # python alone: one process, as accelerate launch with one
    if args.precision == "fp16" and not torch.cuda.is_available():  # accelerate would train in fp32
        parser.error("--precision fp16 needs a GPU: accelerate scales losses there only; use bf16 or fp32")
    for signum in NAMES:  # noted; acted on at the next log line
        signal.signal(signum, lambda signum, frame: STOP.append(NAMES[signum]))
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),  # gloo, where plain Accelerator() trains each process alone
        mixed_precision=PRECISIONS.get(args.precision),  # else the config's
        gradient_accumulation_steps=args.grad_accum,
        dynamo_backend="inductor" if args.compile else None,  # torch.compile, else as the config says
        # shuffled by the seed and the epoch alone: a resumed epoch's order is the one it stopped in
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=args.timeout))],
    )
    set_seed(args.seed)  # the model starts alike in every process
    device, rank = accelerator.device, f"{accelerator.process_index}/{accelerator.num_processes}"
    backend = dist.get_backend() if dist.is_initialized() else "one process"
    sys.stdout.write(f"[rank {rank}] {device}, {backend}\n")
    train_set, val_set, model, optimizer = load_train_objs(args)
    loading = {"num_workers": args.workers, "pin_memory": device.type == "cuda"}  # pinned: faster
    train_data = DataLoader(train_set, args.batch_size, shuffle=True, drop_last=True, **loading)
    val_data = DataLoader(val_set, args.batch_size, **loading)
    Trainer(model, train_data, val_data, optimizer, accelerator, args).train()
    accelerator.end_training()


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
    parser.add_argument("--precision", choices=PRECISIONS, help="default: the config's")
    parser.add_argument("--workers", type=int, default=2, help="loader processes a rank")
    parser.add_argument("--warmup", type=int, default=10, help="steps of rising learning rate")
    parser.add_argument("--clip", type=float, default=1.0, help="largest gradient norm (0: none)")
    parser.add_argument("--log_every", type=int, default=10, help="steps between log lines")
    parser.add_argument("--save_steps", type=int, default=0, help="steps between snapshots too")
    parser.add_argument("--compile", action="store_true", help="the model through torch.compile")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--snapshot_path", default="recipe_accelerate_snapshot", help="a folder")
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
    images = torch.tensor(pixels, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16
    labels = torch.tensor(digits)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(args.seed))
    val, train = order[:359], order[359:]  # of the 1,797 images
    train_set, val_set = Augmented(images[train], labels[train]), TensorDataset(images[val], labels[val])
    train_set.seed = args.seed
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
        accelerator.load_state(path)  # into the prepared model, optimizer, scheduler and scaler
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
