"""Step 3, with Hugging Face Accelerate: multigpu_torchrun.py again, to compare line by line.

    torchrun --standalone --nproc-per-node=2 multigpu_accelerate.py 10 5
    accelerate launch --multi_gpu --num_processes=2 multigpu_accelerate.py 10 5    # on a GPU machine

Changes from multigpu_torchrun.py: Accelerator() sets up the process group and picks the device; prepare()
wraps the model in DDP and splits each epoch's batches among the processes; accelerator.backward() replaces
loss.backward(). Without CUDA, Accelerator(cpu=True) is needed: plain Accelerator() would let every process
train alone, unsynchronised, without an error.
"""

import argparse
import ctypes
import hashlib
import json
import os
import pickle
import socket
import sys
import time
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Trainer:
    def __init__(self, model, train_data, optimizer, loss_fn, accelerator, args):
        self.accelerator = accelerator
        self.rank = accelerator.process_index
        self.world_size = accelerator.num_processes
        self.device = device = accelerator.device
        self.model = to_device(model, device, args)
        self.loss_fn = loss_fn
        self.args = args
        self.epochs_run = 0
        if os.path.exists(args.snapshot_path):
            self.epochs_run = load_snapshot(args.snapshot_path, self.model, optimizer, device, args.workload)
            if self.rank == 0:
                print(resume_message(args, self.epochs_run), flush=True)
        # DDP around the model, the optimizer wrapped, each process given every world_size-th batch
        self.model, self.optimizer, self.train_data = accelerator.prepare(self.model, optimizer, train_data)
        register_comm_hook(self.model, args)

    def _run_batch(self, source, targets, scale, step):
        # no_sync: gradients stay local and add up; the group's last backward all-reduces their sum
        with nullcontext() if step else self.accelerator.no_sync(self.model):
            with autocast(self.args, self.device):
                loss = self.loss_fn(self.model(source), targets)
            self.accelerator.backward(loss * scale)
        if step:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def _run_epoch(self, epoch):
        self.train_data.set_epoch(epoch)  # a new, seeded order every epoch
        torch.manual_seed(self.args.seed + epoch)  # random transforms repeat exactly after a resume
        totals = torch.zeros(2, device=self.device)  # sum of losses, number of samples
        for source, targets, scale, step in micro_batches(self.train_data, self.args.grad_accum):
            source, targets = to_device(source, self.device, self.args), targets.to(self.device)
            loss = self._run_batch(source, targets, scale, step)
            totals += torch.stack([loss * len(source), loss.new_tensor(len(source))])
        return totals

    def _save_snapshot(self, epochs_run):
        save_snapshot(
            self.args.snapshot_path,
            self.accelerator.unwrap_model(self.model),
            self.optimizer,
            epochs_run,
            self.args.workload,
        )

    def train(self):
        for epoch in range(self.epochs_run, self.args.total_epochs):
            start = time.perf_counter()
            totals = self._run_epoch(epoch)
            totals = self.accelerator.reduce(totals, reduction="sum")  # over all processes
            loss_sum, samples = totals.tolist()
            if self.rank == 0:
                seconds = time.perf_counter() - start
                log_epoch(self.args, epoch + 1, loss_sum / samples, samples, seconds, self.world_size)
                if (epoch + 1) % self.args.save_every == 0 or epoch + 1 == self.args.total_epochs:
                    self._save_snapshot(epoch + 1)
        check_weights_in_sync(self.accelerator.unwrap_model(self.model))


def prepare_dataloader(dataset, args):
    return DataLoader(
        dataset,
        batch_size=args.batch_size,
        pin_memory=torch.cuda.is_available(),
        num_workers=args.num_workers,
        # one seeded order for all processes; accelerator.prepare() hands each process its own batches
        sampler=DistributedSampler(dataset, num_replicas=1, rank=0, seed=args.seed),
    )


def main(args, train_objs):
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),  # gloo on the CPU: without it each process would train alone
        kwargs_handlers=[
            InitProcessGroupKwargs(timeout=timedelta(seconds=args.collective_timeout)),
            DistributedDataParallelKwargs(**ddp_options(args)),  # --bucket_cap_mb and the like
        ],
    )
    train_set, model, optimizer, loss_fn = train_objs  # from check_launch, before joining the group
    train_data = prepare_dataloader(train_set, args)
    describe_world()
    Trainer(model, train_data, optimizer, loss_fn, accelerator, args).train()
    accelerator.end_training()


def check_launch(parser, args):
    """Catch a plain `python` start and bad input in every process, before any of them joins the group.
    Returns what load_train_objs built, so that main() does not build it again."""
    if "LOCAL_RANK" not in os.environ:
        parser.error("start me with torchrun, e.g. torchrun --standalone --nproc-per-node=2 " + sys.argv[0])
    gpus, local_procs = torch.cuda.device_count(), int(os.environ["LOCAL_WORLD_SIZE"])
    if gpus and local_procs > gpus:
        parser.error(f"{local_procs} processes per node but only {gpus} GPUs: lower --nproc-per-node")
    try:
        train_objs = load_train_objs(args)
        check_dataset(parser, train_objs[0], int(os.environ["WORLD_SIZE"]), args.batch_size)
    except ValueError as exc:
        parser.error(str(exc))
    return train_objs


# Below: the plumbing every example shares, kept identical in all of them (tests/test_structure.py
# checks), so that the lesson above reads first. Python looks these names up when main() runs.


# ---- shared: arguments ----
def get_parser():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("total_epochs", type=int, help="epochs to train in all")
    parser.add_argument("save_every", type=int, help="write a snapshot every this many epochs")
    parser.add_argument(
        "--batch_size", type=int, default=32, help="samples per step per process (default 32)"
    )
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    parser.add_argument("--seed", type=int, default=0, help="seed for data, initial weights and shuffling")
    script = os.path.splitext(os.path.basename(sys.argv[0]))[0]
    parser.add_argument(
        "--snapshot_path", default=f"{script}_snapshot.pt", help="resume from, save to (default: %(default)s)"
    )
    parser.add_argument("--metrics_path", help="append one JSON line per epoch to this file")
    parser.add_argument("--workload", choices=["tiny", "vision"], default="tiny", help="default: tiny")
    parser.add_argument("--data_dir", help="vision: an ImageFolder tree (class/image.png); default synthetic")
    parser.add_argument(
        "--dataset_size", type=int, default=2048, help="samples when generated (default 2048)"
    )
    parser.add_argument(
        "--image_size", type=int, default=32, help="vision: image side in pixels (default 32)"
    )
    parser.add_argument("--num_workers", type=int, default=0, help="DataLoader worker processes (default 0)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=60,
        help="mp.spawn: seconds to wait for the others to join (default 60)",
    )
    parser.add_argument(
        "--collective_timeout",
        type=float,
        default=600,
        help="seconds a collective waits for the slowest process before the run fails (default 600)",
    )
    parser.add_argument(
        "--grad_accum", type=int, default=1, help="batches whose gradients add up to one step (default 1)"
    )
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast in forward and loss (GPUs)")
    parser.add_argument("--channels_last", action="store_true", help="vision: NHWC layout (GPU convolutions)")
    return parser


def check_args(parser, args):
    """Reject bad input before any work starts: argparse-style message, exit status 2."""
    for name in (
        "total_epochs",
        "save_every",
        "batch_size",
        "dataset_size",
        "image_size",
        "lr",
        "timeout",
        "collective_timeout",
        "grad_accum",
    ):
        if getattr(args, name) <= 0:
            parser.error(f"{name} must be positive, got {getattr(args, name)}")
    if args.num_workers < 0:
        parser.error(f"num_workers must be 0 or more, got {args.num_workers}")
    if args.data_dir and args.workload != "vision":
        parser.error("--data_dir needs --workload vision")
    if args.data_dir and not os.path.isdir(args.data_dir):
        parser.error(f"--data_dir {args.data_dir} is not a directory")


def check_dataset(parser, train_set, world_size, batch_size):
    if len(train_set) < world_size * batch_size:
        parser.error(
            f"the dataset has {len(train_set)} samples, fewer than one step needs: "
            f"{world_size} process(es) x batch_size {batch_size}"
        )


# ---- end shared ----


# ---- shared: workloads ----
def tiny_dataset(size, seed):
    """Linear regression toward a hidden target, generated from the seed: the same in every process."""
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size, 20, generator=gen)
    weight, bias = torch.randn(20, 1, generator=gen), torch.randn(1, generator=gen)
    targets = inputs @ weight + bias + 0.01 * torch.randn(size, 1, generator=gen)
    return TensorDataset(inputs, targets)


def vision_dataset(args):
    """Images from an ImageFolder tree, or synthetic ones: each class a fixed pattern plus noise."""
    if args.data_dir:
        from torchvision import datasets, transforms

        transform = transforms.Compose(
            [
                transforms.Resize((args.image_size, args.image_size)),
                transforms.RandomHorizontalFlip(),
                transforms.ToTensor(),
                transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
            ]
        )
        try:
            return datasets.ImageFolder(args.data_dir, transform=transform)
        except (FileNotFoundError, OSError) as exc:
            raise ValueError(f"--data_dir {args.data_dir}: {exc}") from None
    gen = torch.Generator().manual_seed(args.seed)
    shape = (3, args.image_size, args.image_size)
    labels = torch.randint(10, (args.dataset_size,), generator=gen)
    patterns = torch.randn(10, *shape, generator=gen)
    images = patterns[labels] + torch.randn(args.dataset_size, *shape, generator=gen)
    return TensorDataset(images, labels)


def load_train_objs(args):
    """The dataset, the model, its optimizer and loss function for the chosen workload."""
    torch.manual_seed(args.seed)  # the same initial weights in every process and every run
    if args.workload == "tiny":
        train_set = tiny_dataset(args.dataset_size, args.seed)
        model, loss_fn = torch.nn.Linear(20, 1), F.mse_loss
    else:
        from torchvision.models import resnet18

        train_set = vision_dataset(args)
        num_classes = len(train_set.classes) if hasattr(train_set, "classes") else 10
        model, loss_fn = resnet18(num_classes=num_classes), F.cross_entropy
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    return train_set, model, optimizer, loss_fn


# ---- end shared ----


# ---- shared: speed ----
def micro_batches(loader, grad_accum):
    """Yield each batch with its loss scale and whether it completes an optimizer step.

    The gradients of grad_accum batches add up before one step. Scaling each loss by 1 / (batches in the
    group) makes the sum the gradient of their mean: the step one batch grad_accum times larger would take.
    """
    count = len(loader)
    for i, (source, targets) in enumerate(loader):
        first = i - i % grad_accum  # the group's first batch; the epoch's last group may be shorter
        size = min(grad_accum, count - first)
        yield source, targets, 1.0 / size, i == first + size - 1


def autocast(args, device):
    """With --bf16: matmuls and convolutions in bfloat16, weights, gradients and updates stay float32."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)


def to_device(obj, device, args):
    """Move a model or a batch to the device; with --channels_last, the model and image batches go NHWC."""
    if args.channels_last and (isinstance(obj, torch.nn.Module) or obj.dim() == 4):
        return obj.to(device, memory_format=torch.channels_last)
    return obj.to(device)


# ---- end shared ----


# ---- shared: snapshots ----
def save_snapshot(path, model, optimizer, epochs_run, workload):
    """Write the snapshot atomically: a crash mid-write leaves the previous one intact."""
    snapshot = {
        "MODEL_STATE": model.state_dict(),
        "OPTIMIZER_STATE": optimizer.state_dict(),
        "EPOCHS_RUN": epochs_run,
        "WORKLOAD": workload,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(snapshot, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_snapshot(path, model, optimizer, device, workload):
    """Restore model and optimizer in place; return the number of epochs already run."""
    try:
        # weights_only: tensors and plain containers only, a pickle that would run code is refused
        location = "cpu" if torch.device(device).type == "cpu" else device  # accelerate says cpu:0
        snapshot = torch.load(path, map_location=location, weights_only=True)
        if snapshot.get("WORKLOAD") != workload:
            raise ValueError(f"it was written by the {snapshot.get('WORKLOAD')!r} workload, not {workload!r}")
        model.load_state_dict(snapshot["MODEL_STATE"])
        optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        return int(snapshot["EPOCHS_RUN"])
    except Exception as exc:  # garbage makes the unpickler fail in many ways; the type is in the message
        reason = f"{type(exc).__name__}: " + (str(exc).strip() or "no detail").splitlines()[0]
        if isinstance(exc, pickle.UnpicklingError):  # torch's text suggests weights_only=False: never do that
            reason = "not a plain weights file: corrupt, or holding objects that would run code when loaded"
        sys.exit(
            f"error: cannot resume from snapshot {path}: {reason}\n"
            "It is unreadable, truncated or from another model. It was left untouched: move it away to "
            "start from scratch, or pass --snapshot_path with a new file."
        )


def resume_message(args, epochs_run):
    if epochs_run >= args.total_epochs:
        return (
            f"{args.snapshot_path} already holds {epochs_run} epochs, nothing to train: raise TOTAL_EPOCHS "
            "to train on, or delete the snapshot to start over"
        )
    return f"resuming from {args.snapshot_path} at epoch {epochs_run + 1}"


def weights_sha256(model):
    """A fingerprint of every parameter, bit for bit. Buffers such as BatchNorm statistics are left out:
    each process updates its own, and DDP copies rank 0's to the others at the start of every forward."""
    digest = hashlib.sha256()
    for tensor in model.parameters():
        t = tensor.detach().cpu().contiguous()
        digest.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    return digest.hexdigest()[:12]


def log_epoch(args, epoch, loss, samples, seconds, world_size):
    print(
        f"epoch {epoch}/{args.total_epochs} | loss {loss:.6g} | {samples / seconds:.0f} samples/s | "
        f"{seconds:.2f} s | world_size {world_size}",
        flush=True,
    )
    if args.metrics_path:
        record = {
            "epoch": epoch,
            "loss": loss,
            "samples_per_s": samples / seconds,
            "epoch_time_s": seconds,
            "world_size": world_size,
        }
        with open(args.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")


# ---- end shared ----


# ---- shared: distributed ----
def describe_world():
    """Rank 0 prints where ranks run: `world_size 4 across 2 hosts (nccl): a ranks 0-1, b ranks 2-3`."""
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    if dist.get_rank() == 0:
        spans = []  # [host, first rank, last rank] for each run of consecutive ranks on one host
        for rank, host in enumerate(hosts):
            if spans and spans[-1][0] == host:
                spans[-1][2] = rank
            else:
                spans.append([host, rank, rank])
        where = ", ".join(f"{h} ranks {a}-{b}" if b > a else f"{h} rank {a}" for h, a, b in spans)
        count = len(set(hosts))
        across = f"{count} host{'s' * (count > 1)} ({dist.get_backend()})"
        print(f"world_size {len(hosts)} across {across}: {where}", flush=True)


def check_weights_in_sync(model):
    """DDP keeps every replica identical; prove it at the end by comparing fingerprints of all ranks."""
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, weights_sha256(model))
    if dist.get_rank() == 0:
        if len(set(digests)) != 1:
            raise RuntimeError(f"final weights differ across ranks: {digests}")
        print(f"final weights sha256 {digests[0]} identical on {len(digests)} ranks", flush=True)


# ---- end shared ----


# ---- shared: ddp_options ----
def add_ddp_options(parser):
    """DistributedDataParallel's own settings; README.md (Performance) says what each costs or buys."""
    group = parser.add_argument_group("DDP options")
    group.add_argument("--comm_hook", choices=["fp16", "bf16"], help="all-reduce gradients in 16 bits")
    group.add_argument("--bucket_cap_mb", type=float, help="gradient MB per all-reduce (DDP default 25)")
    group.add_argument("--gradient_as_bucket_view", action="store_true", help="gradients live in the buckets")
    group.add_argument("--static_graph", action="store_true", help="the same graph every step: plan once")


def check_ddp_options(parser, args):
    if args.bucket_cap_mb is not None and args.bucket_cap_mb <= 0:
        parser.error(f"bucket_cap_mb must be positive, got {args.bucket_cap_mb}")
    if args.static_graph and args.grad_accum > 1:
        parser.error("--static_graph fails under no_sync, so it cannot be combined with --grad_accum")


def ddp_options(args):
    """Keyword arguments for DistributedDataParallel, or for accelerate's DistributedDataParallelKwargs."""
    keys = ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph")
    return {key: getattr(args, key) for key in keys if getattr(args, key)}  # only those given


def register_comm_hook(model, args):
    """--comm_hook: each bucket is cast to 16 bits, all-reduced and cast back; the optimizer sees float32."""
    if args.comm_hook and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model.register_comm_hook(None, getattr(default_hooks, f"{args.comm_hook}_compress_hook"))


# ---- end shared ----


if __name__ == "__main__":
    parser = get_parser()
    add_ddp_options(parser)
    args = parser.parse_args()
    check_args(parser, args)
    check_ddp_options(parser, args)
    main(args, check_launch(parser, args))
