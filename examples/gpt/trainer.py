"""The training loop: processes, precision, the step with accumulation, evaluation, snapshots. How the model
is split over the processes is parallel.py's business: the trainer sees a Parallel whatever the layout."""

import json
import math
import os
import sys
import time
from dataclasses import asdict
from datetime import timedelta

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
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
]


def setup_processes(timeout=600):
    """(rank, world size, device). Under torchrun: join the process group (NCCL on GPUs, else gloo); a
    process that waits longer than `timeout` seconds for the others, then or in any collective, fails."""
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
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    return rank, world, device


def peak_flops(args, device):
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((flops for key, flops in PEAK_FLOPS if key in name), None)
    return None


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
        layout = self.layout = args.layout
        self.leads = rank == layout.leader  # logs, records the metrics, commits snapshots
        self.dp_rank, self.dp_world = layout.dp_rank(rank), layout.dp
        self.corpus = corpus
        # memory-mapped shards: each process reads the windows of its own share of every batch, no more
        self.train_data, self.val_data = corpus.train, corpus.val
        if args.in_memory:  # the whole corpus on the device instead, batches indexed there (for comparison)
            self.train_data, self.val_data = corpus.train.long().to(device), corpus.val.long().to(device)
        self.global_batch = args.batch_size * args.grad_accum * self.dp_world
        self.dtype = resolve_dtype(args.dtype, device)
        with torch.device("meta"):  # no storage: each process materialises its own part below
            model = GPT(model_config(args, corpus.vocab_size))
        self.params, self.flops_per_token = (
            parameter_count(model, non_embedding=False),
            flops_per_token(model),
        )
        param_dtype = torch.bfloat16 if self.dtype == torch.bfloat16 else None  # FSDP's all-gathers
        self.parallel = parallel.parallelize(model, layout, args, device, param_dtype)
        self.raw = self.parallel.module  # this process's part of the GPT
        groups = optimizer_groups(self.raw, args.weight_decay)
        self.optimizer = parallel.make_optimizer(groups, layout, self.parallel.mesh, device)
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.dtype == torch.float16)
        self.step = 0
        # dropout: a stream per share of the batch; the processes of one share (tp, pp) draw alike
        torch.manual_seed(args.seed + 1 + self.dp_rank)
        if snapshot is not None:
            self.restore(snapshot)
        self.peak = peak_flops(args, device)

    # ---- snapshots -----------------------------------------------------------------------------------
    def extra_state(self):
        """Everything a resumed run needs besides the weights and the optimizer state (which every process
        writes in parts): the data position is the step itself. A collective (the random states)."""
        rng = all_ranks({"cpu": torch.get_rng_state(), "cuda": self._cuda_rng()})
        return {
            "config": snapshot_config(self.args, self.corpus),
            "tokenizer": None if self.corpus.tokenizer is None else self.corpus.tokenizer.to_str(),
            "scaler": self.scaler.state_dict(),
            "step": self.step,
            "seed": self.args.seed,
            "global_batch": self.global_batch,
            "schedule": {key: getattr(self.args, key) for key in SCHEDULE_KEYS},
            "rng": rng,  # one entry per process
            "layout": self.layout.as_dict(),  # whose processes drew those streams
        }

    def _cuda_rng(self):
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None

    def restore(self, snapshot):
        optimizer = parallel.local_optimizer(self.optimizer)
        if "shards" not in snapshot:  # a single file (--init_from): made this run's first snapshot
            snapshot["shards"] = checkpoint.import_file(self.args.snapshot_path, snapshot, self.layout.leader)
        checkpoint.load_shards(snapshot["shards"], self.raw, optimizer)  # each process reads its own parts
        self.scaler.load_state_dict(snapshot["scaler"])
        self.step = int(snapshot["step"])
        rng = snapshot["rng"]
        # same processes and layout: each continues its own dropout stream
        if (len(rng), snapshot.get("layout")) == (self.world, self.layout.as_dict()):
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
        """A collective: every process writes its parts, the leader the rest (checkpoint.save)."""
        extra = self.extra_state()
        optimizer = parallel.local_optimizer(self.optimizer)
        checkpoint.save(self.args.snapshot_path, self.raw, optimizer, extra, self.layout.leader)

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
            mine = offsets[start : start + a.batch_size]
            x, y = data.gather(self.train_data, mine, a.block_size, self.device)
            # gradients add up locally; only the last micro-batch's backward reduces them over processes
            with self.parallel.sync(micro == a.grad_accum - 1), self.autocast():
                loss_sum += self.parallel.step(x, y, self.backward)
        if a.grad_clip:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not fp16-scaled ones
            parallel.clip_grad_norm_(self.parallel, a.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss_sum / a.grad_accum

    def backward(self, loss):
        self.scaler.scale(loss / self.args.grad_accum).backward()

    @torch.no_grad()
    def evaluate(self):
        """Mean validation loss over a fixed set of sequences, shared out among the data-parallel shares."""
        a = self.args
        self.parallel.train(False)
        offsets = data.step_offsets(a.seed, -1, a.eval_samples, len(self.val_data), a.block_size)
        totals = torch.zeros(2, device=self.device, dtype=torch.float64)  # loss sum, sequences
        mine = offsets[self.dp_rank :: self.dp_world]
        # every process runs as many forwards (sharded weights are gathered in each): the largest share's
        for start in range(0, -(-len(offsets) // self.dp_world), a.batch_size):
            chunk = mine[start : start + a.batch_size]
            x, y = data.gather(self.val_data, chunk if len(chunk) else offsets[:1], a.block_size, self.device)
            with self.autocast():
                loss = self.parallel.loss(x, y)
            if len(chunk):
                totals += torch.stack([loss.double() * len(chunk), totals.new_tensor(len(chunk))])
        if dist.is_initialized():  # the processes of one share (tp, pp) add the same terms: the mean holds
            dist.all_reduce(totals)
        self.parallel.train(True)
        return (totals[0] / totals[1]).item()

    # ---- the run -------------------------------------------------------------------------------------
    def log(self, text):
        if self.leads:
            print(text, flush=True)

    def record(self, **fields):
        if self.leads and self.args.metrics_path:
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
        tokens = f"{self.corpus.tokenizer.kind} tokenizer" if self.corpus.tokenizer else "no tokenizer"
        self.log(
            f"model {a.model}: {params:.2f}M parameters, vocabulary {self.corpus.vocab_size}, {tokens}, "
            f"{len(self.train_data)} training tokens | {self.world} process(es) on {self.device.type}, "
            f"{dtype} | layout {self.layout.describe()} | global batch {self.global_batch} x "
            f"{a.block_size} tokens"
        )
        if self.corpus.unigram is not None:
            self.log(f"unigram entropy of the training text: {self.corpus.unigram:.4f}")
        meter = MemoryMeter(self.raw, self.optimizer)
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
        if self.leads:
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
        self.check_replicas()
        if self.args.sample_chars:  # every process takes part: a split model's forward is a collective
            self.log("sample:\n" + self.sample(self.args.sample_chars))

    def check_replicas(self):
        """Processes that hold copies of the same part (along the dimensions that replicate it) must end
        with it bit for bit: compared by digest, nothing gathered."""
        if self.world == 1:
            return
        compared, mismatches = parallel.replica_mismatches(
            self.layout, all_ranks(parallel.replica_digests(self.parallel))
        )
        if mismatches:
            raise RuntimeError("replicas differ at the end of the run: " + "; ".join(mismatches))
        self.log(
            f"replicas identical: {compared} copies compared across ranks"
            if compared
            else "no weights are replicated across processes in this layout: no replicas to compare"
        )

    def sample(self, count):
        self.parallel.train(False)
        idx = torch.tensor([[self.corpus.start_id()]], device=self.device)
        gen = torch.Generator().manual_seed(self.args.seed)
        with self.autocast():
            out = self.parallel.generate(idx, count, top_k=40, generator=gen)
        self.parallel.train(True)
        return self.corpus.decode(out[0, 1:].tolist())


def model_config(args, vocab_size):
    return GPTConfig(vocab_size=vocab_size, **{key: getattr(args, key) for key in MODEL_KEYS})


def snapshot_config(args, corpus):
    """What must match for a snapshot to load into this run: the model's shape and its tokenizer."""
    cfg = asdict(model_config(args, corpus.vocab_size))
    del cfg["dropout"]  # may change between runs
    cfg["tokenizer_sha256"] = corpus.digest
    cfg["qkv_layout"] = "per_head"  # the fused q, k, v outputs head by head (before: all q, all k, all v)
    return cfg
