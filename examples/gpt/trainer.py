"""The training loop: processes, parallelism, precision, the step with accumulation, evaluation, snapshots."""

import hashlib
import json
import math
import os
import sys
import time
from dataclasses import asdict

import checkpoint
import data
import parallel
import torch
import torch.distributed as dist
from config import MODEL_KEYS, resolve_dtype
from memory import MemoryMeter
from model import GPT, GPTConfig, flops_per_token, optimizer_groups, parameter_count

# The run's learning-rate schedule and length, kept in snapshots: a resumed run says what it changes.
SCHEDULE_KEYS = ("lr", "min_lr", "warmup_steps", "decay_steps", "max_steps", "weight_decay")
# Dense bfloat16 peak FLOP/s by GPU name, the denominator of MFU; --peak_tflops for others.
PEAK_FLOPS = [
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
]


def setup_processes():
    """(rank, world size, device). Under torchrun: join the process group (NCCL on GPUs, else gloo)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        torch.backends.cuda.matmul.allow_tf32 = True  # float32 matmuls (--dtype fp32) on tensor cores
        torch.backends.cudnn.allow_tf32 = True
    else:
        device = torch.device("cpu")
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


def peak_flops(args, device):
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((flops for key, flops in PEAK_FLOPS if key in name), None)
    return None


def weights_sha256(tensors):
    """A digest of the tensors' bytes, to compare processes' copies without sending the tensors."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:12]


def all_ranks(obj):
    """obj from every process, in rank order."""
    if not dist.is_initialized():
        return [obj]
    objs = [None] * dist.get_world_size()
    dist.all_gather_object(objs, obj)
    return objs


class Trainer:
    def __init__(self, args, corpus, snapshot, rank, world, device):
        self.args, self.rank, self.world, self.device = args, rank, world, device
        self.dp_rank, self.dp_world = parallel.data_parallel_layout(args, rank, world)
        ids, self.vocab = corpus
        train, val = data.split(ids, args.block_size)
        # the whole corpus lives on the device; batches are indexed there, not gathered sample by sample
        self.train_data, self.val_data = train.to(device), val.to(device)
        self.unigram = data.unigram_entropy(train, len(self.vocab))
        self.global_batch = args.batch_size * args.grad_accum * self.dp_world
        torch.manual_seed(args.seed)  # the same initial weights in every process
        self.raw = GPT(model_config(args, len(self.vocab))).to(device)
        # the whole model's size, before tp or pp leave each process a part of it
        self.params, self.flops_per_token = parameter_count(self.raw), flops_per_token(self.raw)
        model = torch.compile(self.raw) if args.compile else self.raw
        # before the optimizer: tp and fsdp replace parameters of self.raw, pp drops some
        self.model = parallel.parallelize(model, args, device)
        self.dtype = resolve_dtype(args.dtype, device)
        groups = optimizer_groups(self.raw, args.weight_decay)
        self.optimizer = parallel.make_optimizer(groups, args, device)
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.dtype == torch.float16)
        self.step = 0
        # dropout: a different stream for every share of the batch; processes that split one model draw alike
        torch.manual_seed(args.seed + 1 + self.dp_rank)
        if snapshot is not None:
            self.restore(snapshot)
        self.peak = peak_flops(args, device)

    # ---- snapshots -----------------------------------------------------------------------------------
    def state(self, weights=True):
        """Everything a resumed run needs to continue exactly; the data position is the step itself.
        weights=False: all but the model and optimizer, which a sharded snapshot holds in shards."""
        rng = all_ranks({"cpu": torch.get_rng_state(), "cuda": self._cuda_rng()})
        if not weights:
            weights = {}
        elif parallel.split_model(self.args):  # the parts gathered, on rank 0 (a collective)
            model, optimizer = parallel.whole_state(self.raw, self.optimizer) or (None, None)
            weights = {"model": model, "optimizer": optimizer}
        else:  # a collective under zero, whose optimizer state is gathered on rank 0
            weights = {
                "model": self.raw.state_dict(),
                "optimizer": parallel.full_optimizer_state(self.optimizer),
            }
        return {
            "config": snapshot_config(self.args, self.vocab),
            "vocab": self.vocab,
            **weights,
            "scaler": self.scaler.state_dict(),
            "step": self.step,
            "seed": self.args.seed,
            "global_batch": self.global_batch,
            "rng": rng,  # one entry per process
            "parallel": self.args.parallel,  # whose processes drew those streams
            "schedule": {key: getattr(self.args, key) for key in SCHEDULE_KEYS},
        }

    def _cuda_rng(self):
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None

    def restore(self, snapshot):
        if "shards" in snapshot:  # a sharded snapshot: each process reads its own part
            checkpoint.load_sharded(snapshot["shards"], self.raw, self.optimizer)
        elif parallel.split_model(self.args):  # each process takes its parts
            parallel.load_whole_state(self.raw, self.optimizer, snapshot["model"], snapshot["optimizer"])
        else:
            self.raw.load_state_dict(snapshot["model"])
            self.optimizer.load_state_dict(snapshot["optimizer"])
        self.scaler.load_state_dict(snapshot["scaler"])
        self.step = int(snapshot["step"])
        rng = snapshot["rng"]
        # same processes and strategy: each continues its own dropout stream (tp's processes draw alike)
        if (len(rng), snapshot.get("parallel", "ddp")) == (self.world, self.args.parallel):
            torch.set_rng_state(rng[self.rank]["cpu"])
            if rng[self.rank]["cuda"] is not None and self.device.type == "cuda":
                torch.cuda.set_rng_state(rng[self.rank]["cuda"], self.device)
        else:
            torch.manual_seed(self.args.seed + 1 + self.dp_rank + self.step * self.dp_world)
        self.compare_schedule(snapshot.get("schedule", {}))
        if (snapshot["seed"], snapshot["global_batch"]) != (self.args.seed, self.global_batch):
            self.log(
                f"note: the snapshot ran with seed {snapshot['seed']} and global batch "
                f"{snapshot['global_batch']}; this run has {self.args.seed} and {self.global_batch}"
            )

    def compare_schedule(self, before):
        """Say what this run changes from the snapshot's. The cosine keeps its end (decay_steps) unless
        --decay_steps is given: raising --max_steps then goes on at min_lr instead of reshaping it."""
        a = self.args
        if "decay_steps" in before and not a.decay_given:
            a.decay_steps = before["decay_steps"]
        changed = [
            f"{key} {before[key]:g} -> {getattr(a, key):g}"
            for key in before
            if before[key] != getattr(a, key)
        ]
        if changed:
            self.log(
                f"note: changed since the snapshot: {', '.join(changed)}. The cosine ends at step "
                f"{a.decay_steps} (--decay_steps moves it); AdamW's weight decay and betas stay as saved"
            )

    def save(self):
        if self.args.parallel in parallel.SHARDED_SNAPSHOTS:  # every process writes its shards
            extra = self.state(weights=False)
            return checkpoint.save_sharded(self.args.snapshot_path, self.raw, self.optimizer, extra)
        state = self.state()  # a collective: every process takes part
        if self.rank == 0:
            checkpoint.save(self.args.snapshot_path, state)

    # ---- one step ------------------------------------------------------------------------------------
    def lr_at(self, step):
        """Linear warmup, then a cosine from lr down to min_lr at decay_steps, then min_lr."""
        a = self.args
        if step < a.warmup_steps:
            return a.lr * (step + 1) / a.warmup_steps
        if step >= a.decay_steps:
            return a.min_lr
        progress = (step - a.warmup_steps) / max(1, a.decay_steps - a.warmup_steps)
        return a.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (a.lr - a.min_lr)

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    def train_step(self):
        a = self.args
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step)
        offsets = data.step_offsets(a.seed, self.step, self.global_batch, len(self.train_data), a.block_size)
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(a.grad_accum):
            # this process's slice of the step's global batch
            start = (self.dp_rank * a.grad_accum + micro) * a.batch_size
            x, y = data.gather(self.train_data, offsets[start : start + a.batch_size], a.block_size)
            if isinstance(self.model, parallel.Pipeline):  # the schedule runs forward and backward
                with self.autocast():
                    loss_sum += self.model.step(x, y)
                continue
            last = micro == a.grad_accum - 1
            # gradients add up locally; only the last micro-batch's backward reduces them over processes
            with parallel.gradient_sync(self.model, last):
                with self.autocast():
                    _, loss = self.model(x, y)
                self.scaler.scale(loss / a.grad_accum).backward()
            loss_sum += loss.detach()
        if a.grad_clip:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not fp16-scaled ones
            parallel.clip_grad_norm_(self.raw, a.grad_clip, a)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss_sum / a.grad_accum

    @torch.no_grad()
    def evaluate(self):
        """Mean validation loss over a fixed set of sequences, shared out among all processes."""
        a = self.args
        self.model.eval()
        offsets = data.step_offsets(a.seed, -1, a.eval_samples, len(self.val_data), a.block_size)
        totals = torch.zeros(2, device=self.device, dtype=torch.float64)  # loss sum, sequences
        mine = offsets[self.dp_rank :: self.dp_world]
        # every process runs as many forwards (sharded weights are gathered in each): the largest share's
        for start in range(0, -(-len(offsets) // self.dp_world), a.batch_size):
            chunk = mine[start : start + a.batch_size]
            x, y = data.gather(self.val_data, chunk if len(chunk) else offsets[:1], a.block_size)
            with self.autocast():
                pipeline = isinstance(self.model, parallel.Pipeline)
                loss = self.model.loss(x, y) if pipeline else self.raw(x, y)[1]
            if len(chunk):
                totals += torch.stack([loss.double() * len(chunk), totals.new_tensor(len(chunk))])
        if dist.is_initialized():
            dist.all_reduce(totals)
        self.model.train()
        return (totals[0] / totals[1]).item()

    # ---- the run -------------------------------------------------------------------------------------
    def log(self, text):
        if self.rank == 0:
            print(text, flush=True)

    def record(self, **fields):
        if self.rank == 0 and self.args.metrics_path:
            os.makedirs(os.path.dirname(os.path.abspath(self.args.metrics_path)), exist_ok=True)
            with open(self.args.metrics_path, "a") as f:
                f.write(json.dumps(fields) + "\n")

    def mean_over_ranks(self, value):
        if dist.is_initialized():
            dist.all_reduce(value)
            value /= self.world
        return value.item()

    def train(self):
        a = self.args
        params, dtype = self.params / 1e6, str(self.dtype).removeprefix("torch.")
        self.log(
            f"model {a.model}: {params:.2f}M parameters, vocabulary {len(self.vocab)}, "
            f"{len(self.train_data)} training characters | {self.world} process(es) on {self.device.type}, "
            f"{dtype} | global batch {self.global_batch} x {a.block_size} tokens"
        )
        self.log(f"unigram entropy of the training text: {self.unigram:.4f}")
        meter = MemoryMeter(self.model, self.optimizer)
        loss_sum, steps, clock = torch.zeros((), device=self.device), 0, time.perf_counter()
        while self.step < a.max_steps:
            loss_sum += self.train_step()
            steps += 1
            last = self.step == a.max_steps
            saving = self.step % a.save_every == 0 or last
            if self.step % a.log_every == 0 or last:
                loss = self.mean_over_ranks(loss_sum / steps)  # also waits for the device to finish
                self.stop_if_diverged(loss)
                self.log_interval(loss, steps, time.perf_counter() - clock)
                loss_sum.zero_()
                steps = 0
            elif saving:  # no snapshot of weights that a non-finite loss has reached
                self.stop_if_diverged(self.mean_over_ranks(loss_sum / steps))
            paused = time.perf_counter()  # evaluation and snapshots stay out of the throughput
            if self.step % a.eval_every == 0 or last:
                val_loss = self.evaluate()
                self.log(f"step {self.step} | val loss {val_loss:.4f}")
                self.record(step=self.step, val_loss=val_loss)
            if saving:
                self.save()
                self.log(f"saved {a.snapshot_path} at step {self.step}")
            clock += time.perf_counter() - paused
            if steps == 0:
                clock = time.perf_counter()
        self.finish(meter)

    def stop_if_diverged(self, loss):
        """Every process sees the same mean loss: all stop together, before anything more is saved."""
        if math.isfinite(loss):
            return
        path = self.args.snapshot_path
        kept = f"{path} still holds the last good snapshot" if os.path.exists(path) else "nothing was saved"
        if self.rank == 0:
            print(
                f"error: the loss became {loss} by step {self.step} (lr {self.lr_at(self.step - 1):.2e}): "
                f"training stopped, {kept}. Lower --lr, or raise --warmup_steps",
                file=sys.stderr,
                flush=True,
            )
        sys.exit(1)

    def log_interval(self, loss, steps, seconds):
        """One line (and one metrics record) for the steps since the last one, nanoGPT style."""
        a, lr = self.args, self.lr_at(self.step - 1)
        tokens_per_s = steps * self.global_batch * a.block_size / seconds
        mfu = None if self.peak is None else tokens_per_s / self.world * self.flops_per_token / self.peak
        self.log(
            f"step {self.step}/{a.max_steps} | loss {loss:.4f} | lr {lr:.2e} | "
            f"{seconds / steps * 1000:.1f} ms/step | {tokens_per_s:.0f} tokens/s | "
            f"mfu {'-' if mfu is None else f'{100 * mfu:.1f}%'}"
        )
        fields = dict(step=self.step, loss=loss, lr=lr, tokens_per_s=tokens_per_s)
        fields.update(step_ms=seconds / steps * 1000, world_size=self.world)
        self.record(**fields, **({} if mfu is None else {"mfu": mfu}))

    def finish(self, meter):
        memory = all_ranks(meter.report(self.device))
        for rank, fields in enumerate(memory):
            self.record(memory=fields, rank=rank)
        most = {key: max(m[key] for m in memory) / 2**20 for key in memory[0] if key.endswith("_bytes")}
        self.log(
            "memory per rank, MiB, the largest: params {params_bytes:.2f} | grads {grads_bytes:.2f} | "
            "optimizer state {optimizer_bytes:.2f} | peak {peak_bytes:.0f}".format(**most)
            + f" ({memory[0]['peak_kind']})"
        )
        # the weights processes hold alike (ddp, zero: all; tp, pp: the shared ones), compared by digest
        what, tensors = parallel.replicas(self.raw, self.args)  # pp: only the first and last stage hold some
        digests = [d for d in all_ranks(weights_sha256(tensors) if tensors else None) if d is not None]
        if not digests and self.world > 1:
            self.log(what)
        elif len(set(digests)) != 1:
            raise RuntimeError(f"{what} differ across processes: {digests}")
        elif self.world > 1:
            self.log(f"{what} identical on {len(digests)} ranks")
        if self.args.sample_chars:
            model = self.raw  # every process generates: a sharded (fsdp) model's forward is a collective
            if parallel.split_model(self.args):  # rank 0 gathers the whole model and generates alone
                whole = parallel.whole_state(self.raw, self.optimizer)
                model = None if whole is None else GPT(self.raw.cfg).to(self.device)
                if model is not None:
                    model.load_state_dict(whole[0])
            if model is not None:
                text = self.sample(model, self.args.sample_chars)
                self.log("sample:\n" + text)

    def sample(self, model, count):
        model.eval()
        start = self.vocab.index("\n") if "\n" in self.vocab else 0
        idx = torch.tensor([[start]], device=self.device)
        gen = torch.Generator().manual_seed(self.args.seed)
        with self.autocast():
            out = model.generate(idx, count, top_k=40, generator=gen)
        model.train()
        return data.decode(out[0, 1:].tolist(), self.vocab)


def model_config(args, vocab_size):
    return GPTConfig(vocab_size=vocab_size, **{key: getattr(args, key) for key in MODEL_KEYS})


def snapshot_config(args, vocab):
    """What must match for a snapshot to load into this run: the model's shape and its vocabulary."""
    cfg = asdict(model_config(args, len(vocab)))
    del cfg["dropout"]  # may change between runs
    cfg["vocab_sha256"] = hashlib.sha256(vocab.encode()).hexdigest()[:16]
    cfg["qkv_layout"] = "per_head"  # the fused q, k, v outputs head by head (before: all q, all k, all v)
    return cfg
