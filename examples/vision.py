"""Run a lesson on ResNet-18 and synthetic 32x32 images, in place of its linear regression.

python vision.py single_gpu.py 10 5
python vision.py multigpu.py 10 5 --nproc 4
torchrun --standalone --nproc-per-node=4 vision.py [--sync_bn] multigpu_torchrun.py 10 5

The lesson runs unchanged but for its load_train_objs, which this file's replaces: a model and data that
keep a GPU busy, for measuring DDP (benchmarks/lessons.py) or seeing it scale. Each image is a pattern of
its class (10 classes) plus noise, so the loss falls. Tried with single_gpu, multigpu, multigpu_torchrun,
multinode and multigpu_accelerate. --sync_bn (GPUs only): BatchNorm's statistics over the global batch,
not each process's share of it (examples/pitfalls/batchnorm_stats.py shows the difference).
"""

import argparse
import ast
import os
import sys

import torch
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import TensorDataset
from torchvision.models import resnet18


def load_train_objs(args):
    """The same in every process, as the lesson's: data, model, optimizer and loss."""
    torch.manual_seed(args.seed)
    targets = torch.randint(10, (args.dataset_size,))
    inputs = torch.randn(10, 3, 32, 32)[targets] + torch.randn(args.dataset_size, 3, 32, 32)
    model = resnet18(num_classes=10)
    if os.environ["VISION_SYNC_BN"] == "1":
        # before the lesson wraps it in DDP; in eval mode it uses its running statistics, as BatchNorm does
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, args.momentum, foreach=True)
    return TensorDataset(inputs, targets), model, optimizer, F.cross_entropy


def usage(message):
    if os.environ.get("LOCAL_RANK", "0") != "0":
        sys.exit(0)  # under torchrun every process meets it: local rank 0 says why, the others end quietly
    if "TORCHELASTIC_ERROR_FILE" in os.environ:
        try:
            refuse(message)
        except argparse.ArgumentError:
            sys.exit(2)
    print(f"usage: {sys.argv[0]} [--sync_bn] LESSON.py ARGS...\nerror: {message}", file=sys.stderr)
    sys.exit(2)


@record  # as the lessons' refusals: said once, as the error in torchrun's closing summary
def refuse(message):
    raise argparse.ArgumentError(None, message)


if __name__ == "__main__":
    sync_bn = sys.argv[1:2] == ["--sync_bn"]
    if sync_bn:
        sys.argv.pop(1)
    if len(sys.argv) < 2 or not os.path.isfile(sys.argv[1]):
        usage("name a lesson's file first")
    if sync_bn and not torch.cuda.is_available():
        usage("--sync_bn needs GPUs: SyncBatchNorm does not run on the CPU")
    # from here on the lesson's own command line; mp.spawn's processes find the lesson and the option in
    # the environment (they run this file again, with its own name in sys.argv[0])
    sys.argv.pop(0)
    os.environ["VISION_LESSON"] = sys.argv[0]
    os.environ["VISION_SYNC_BN"] = str(int(sync_bn))
lesson = os.environ["VISION_LESSON"]
with open(lesson) as file:
    tree = ast.parse(file.read(), lesson)
__doc__ = ast.get_docstring(tree)
# the lesson's code, run here (and as __main__ when this file is) without its own load_train_objs
tree.body = [node for node in tree.body if getattr(node, "name", None) != "load_train_objs"]
exec(compile(tree, lesson, "exec"))
