"""The training loop: processes, precision, the step with accumulation, evaluation, snapshots. How the model
is split over the processes is parallel.py's business: the trainer sees a Parallel whatever the layout."""

import math
import os
import time
from contextlib import nullcontext
from datetime import timedelta

import data
import parallel
import torch
import torch.distributed as dist
from config import resolve_dtype
from failures import guards
from model import GPT, attention_kernel, flops_per_token, optimizer_groups, parameter_count
from observability.memory import MemoryHistory, MemoryMeter
from observability.metrics import Metrics, RankTimes
from observability.traces import StepProfiler
from snapshots import train_state
from snapshots.train_state import all_ranks, model_config
from torch.distributed.tensor.experimental import implicit_replication

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
        # device_id: NCCL connects at once, here, not at the first collective
        device_id = device if device.type == "cuda" else None
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout), device_id=device_id)
    return rank, world, device


def peak_flops(args, device):
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((flops for key, flops in PEAK_FLOPS if key in name), None)
    return None


def lr_at(a, step):
    """Linear warmup, then a cosine from lr down to min_lr at decay_steps, then min_lr."""
    if step < a.warmup_steps:
        return a.lr * (step + 1) / a.warmup_steps
    if step >= a.decay_steps:
        return a.min_lr
    progress = (step - a.warmup_steps) / max(1, a.decay_steps - a.warmup_steps)
    return a.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (a.lr - a.min_lr)


class Trainer:
    def __init__(self, args, corpus, snapshot, rank, world, device):
        self.args, self.rank, self.world, self.device = args, rank, world, device
        layout = self.layout = args.layout
        self.leads = rank == layout.leader  # logs, records the metrics, commits snapshots
        self.metrics = Metrics(args.metrics_path, self.leads, not args.no_tensorboard)
        self.log = self.metrics.log
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
        self.llmc_flops_per_token = flops_per_token(model, llmc=True)  # MFU as llm.c counts it too
        param_dtype = torch.bfloat16 if self.dtype == torch.bfloat16 else None  # FSDP's all-gathers
        self.parallel = parallel.parallelize(model, layout, args, device, param_dtype)
        self.raw = self.parallel.module  # this process's part of the GPT
        groups = optimizer_groups(self.raw, args.weight_decay)
        self.optimizer = parallel.make_optimizer(groups, layout, self.parallel.mesh, device)
        self.scaler = guards.LossScaler(enabled=self.dtype == torch.float16, device=device)
        self.step = 0
        self.checks = guards.Checks(args.skip_nonfinite, self.scaler.enabled, self.log)
        # dropout: a stream per share of the batch; the processes of one share (tp, pp) draw alike
        torch.manual_seed(args.seed + 1 + self.dp_rank)
        if snapshot is not None:
            train_state.restore(self, snapshot)
        self.peak = peak_flops(args, device)

    def save(self, rng):
        """A collective: train_state.save. Returns the seconds it took."""
        start = time.perf_counter()
        train_state.save(self, rng)
        self.log(f"saved {self.args.snapshot_path} at step {self.step}")
        return time.perf_counter() - start

    # ---- one step ------------------------------------------------------------------------------------
    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    def train_step(self, stop):
        """Forward and backward over the micro-batches, then the checks (guards.verdict), no update yet:
        the verdict, a tensor on the device."""
        a = self.args
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.args, self.step)
        offsets = data.step_offsets(a.seed, self.step, self.global_batch, len(self.train_data), a.block_size)
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(a.grad_accum):
            # this process's slice of the step's global batch
            start = (self.dp_rank * a.grad_accum + micro) * a.batch_size
            mine = offsets[start : start + a.batch_size]
            with self.times:  # its own pace: the data, and the forward pass in step()
                x, y = data.gather(self.train_data, mine, a.block_size, self.device)
            # gradients add up locally; only the last micro-batch's backward reduces them over processes
            with self.parallel.sync(micro == a.grad_accum - 1), self.autocast():
                loss_sum += self.parallel.step(x, y, self.backward)
        self.scaler.unscale(self.raw.parameters())  # clip and check the true gradients
        norm = parallel.clip_grad_norm_(self.parallel, a.grad_clip or math.inf)
        return guards.verdict(loss_sum / a.grad_accum, norm, stop)

    def update(self, verdict):
        """The optimizer step, decided on the device: fused AdamW skips it where the verdict says a loss or
        a gradient is not finite (its found_inf), and fp16's loss scale halves or grows."""
        skip = guards.skip(verdict)
        parallel.local_optimizer(self.optimizer).found_inf = skip
        with implicit_replication():  # found_inf beside DTensor parameters: the same on every process
            self.optimizer.step()
        self.scaler.update(skip)
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1

    def reads(self, step):
        """Whether the host reads the checks at this step (1-based): it logs, evaluates or is the last."""
        a = self.args
        return step % a.log_every == 0 or step % a.eval_every == 0 or step == a.max_steps

    def backward(self, loss):
        self.scaler.scale(loss / self.args.grad_accum).backward()

    @torch.no_grad()
    def evaluate(self):
        """Mean validation loss over a fixed set of sequences, shared out among the data-parallel shares."""
        a = self.args
        self.parallel.train(False)
        offsets = data.step_offsets(a.seed, -1, a.eval_samples, len(self.val_data), a.block_size)
        loss_sum, count = torch.zeros((), device=self.device, dtype=torch.float64), 0
        mine = offsets[self.dp_rank :: self.dp_world]
        # every process runs as many forwards (sharded weights are gathered in each): the largest share's
        for start in range(0, -(-len(offsets) // self.dp_world), a.batch_size):
            chunk = mine[start : start + a.batch_size]
            x, y = data.gather(self.val_data, chunk if len(chunk) else offsets[:1], a.block_size, self.device)
            with self.autocast():
                loss = self.parallel.loss(x, y)
            if len(chunk):
                loss_sum += loss.double() * len(chunk)
                count += len(chunk)
        # the count goes to the device once, not once a batch
        totals = torch.stack([loss_sum, loss_sum.new_tensor(count)])
        if dist.is_initialized():  # the processes of one share (tp, pp) add the same terms: the mean holds
            dist.all_reduce(totals)
        self.parallel.train(True)
        return (totals[0] / totals[1]).item()

    # ---- the run -------------------------------------------------------------------------------------
    def train(self, stop):
        """Steps until --max_steps, or until `stop` (preempt.StopRequest) is set on some process: then, at
        the next step that reads the checks (within --log_every steps), the state at its start is saved and
        False returned. A snapshot due after step s is written only once step s + 1's loss shows its
        weights sound, before that step's update: no snapshot holds weights that gave a non-finite loss.
        The last one is checked by the final validation loss."""
        a = self.args
        params, dtype = self.params / 1e6, str(self.dtype).removeprefix("torch.")
        tokens = f"{self.corpus.tokenizer.kind} tokenizer" if self.corpus.tokenizer else "no tokenizer"
        kernel = attention_kernel(self.raw.cfg, self.device, self.dtype, self.raw.cfg.dropout)
        self.log(
            f"model {a.model}: {params:.2f}M parameters, vocabulary {self.corpus.vocab_size}, {tokens}, "
            f"{len(self.train_data)} training tokens | {self.world} process(es) on {self.device.type}, "
            f"{dtype}, attention {kernel} | layout {self.layout.describe()} | global batch "
            f"{self.global_batch} x {a.block_size} tokens"
        )
        if self.corpus.unigram is not None:
            self.log(f"unigram entropy of the training text: {self.corpus.unigram:.4f}")
        meter = MemoryMeter(self.raw, self.optimizer, self.parallel)
        history = MemoryHistory(a.memory_snapshot and f"{a.memory_snapshot}.rank{self.rank}", self.device)
        # --slow_factor 0: nothing timed (on a GPU, events no gather would read)
        self.times = self.parallel.forward_timer = RankTimes(self.device) if a.slow_factor else nullcontext()
        profiler = a.profile_steps and StepProfiler(a.profile_steps, a.profile_dir, self.rank, self.device)
        save, steps, clock, norm = guards.DeferredSave(a.save_every), 0, time.perf_counter(), math.nan
        while self.step < a.max_steps:
            if profiler:
                profiler.at_step(self.step + 1)
            reads = meter.active = save.due or self.reads(self.step + 1)
            rng = train_state.rng_state(self.device) if reads else None  # what a save before the update holds
            verdict = self.train_step(bool(stop))
            self.checks.add(self.step + 1, verdict)
            if reads:
                norm, loss_ok, stopping = self.checks.read()
                if save.take(loss_ok) or (stopping and loss_ok):
                    clock += self.save(rng)
                if stopping and loss_ok:
                    self.log(stop.said(self.step + 1, a.snapshot_path))
                    history.dump()
                    return False
            self.update(verdict)
            steps += 1
            last = self.step == a.max_steps
            if self.step % a.log_every == 0 or last:
                self.log_interval(self.checks.mean_loss(), norm, steps, time.perf_counter() - clock)
                steps, clock = 0, time.perf_counter()
            clock += self.evaluate_and_save(last)
            save.after(self.step)
        if profiler:
            profiler.finish()
        history.dump()
        self.finish(meter)
        return True

    def evaluate_and_save(self, last):
        """The validation loss when due, and the last snapshot: the seconds they took, which stay out of
        the throughput."""
        a, start = self.args, time.perf_counter()
        if self.step % a.eval_every == 0 or last:
            val_loss = self.evaluate()
            self.log(f"step {self.step} | val loss {val_loss:.4f}")
            self.metrics.record(self.step, val_loss=val_loss)
            if last and not math.isfinite(val_loss):
                raise guards.Diverged(f"the validation loss became {val_loss} at step {self.step}")
        if last:
            self.save(train_state.rng_state(self.device))
        return time.perf_counter() - start

    def log_interval(self, loss, norm, steps, seconds):
        """One line (and one metrics record) for the steps since the last one, nanoGPT style; the gradient
        norm is the last step's, before clipping."""
        a, lr = self.args, lr_at(self.args, self.step - 1)
        tokens_per_s = steps * self.global_batch * a.block_size / seconds
        mfu = None if self.peak is None else tokens_per_s / self.world * self.flops_per_token / self.peak
        self.log(
            f"step {self.step}/{a.max_steps} | loss {loss:.4f} | grad norm {norm:.3g} | lr {lr:.2e} | "
            f"{seconds / steps * 1000:.1f} ms/step | {tokens_per_s:.0f} tokens/s | "
            f"mfu {'-' if mfu is None else f'{100 * mfu:.1f}%'}"
        )
        fields = dict(loss=loss, grad_norm=norm, lr=lr, tokens_per_s=tokens_per_s)
        fields.update(step_ms=seconds / steps * 1000)
        times = self.times.gather(steps) if a.slow_factor else []  # a collective
        if len(times) > 1 and self.layout.pp == 1:  # a pipeline's forward passes wait for each other
            line, slow = self.times.report(times, a.slow_factor)
            self.log(f"step {self.step} | {line}")
            fields.update(rank_ms=times, slow_ranks=slow)
        per_rank = {f"ranks/data_forward_ms/rank{r}": ms for r, ms in enumerate(times)}
        fields.update(world_size=self.world, skipped=self.checks.skipped)
        if mfu is not None:  # also as llm.c counts the FLOPs
            fields.update(mfu=mfu, mfu_llmc=mfu * self.llmc_flops_per_token / self.flops_per_token)
        self.metrics.record(self.step, scalars=per_rank, **fields)

    def finish(self, meter):
        memory = all_ranks(meter.report(self.device))
        for rank, fields in enumerate(memory):
            scalars = {f"memory/{k}/rank{rank}": v for k, v in fields.items() if k.endswith("_bytes")}
            self.metrics.record(self.step, scalars, memory=fields, rank=rank)
        most = {key: max(m[key] for m in memory) / 2**20 for key in memory[0] if key.endswith("_bytes")}
        self.log(
            "memory per rank, MiB, the largest: params {params_bytes:.2f} | grads {grads_bytes:.2f} | "
            "optimizer state {optimizer_bytes:.2f} | peak {peak_bytes:.0f}".format(**most)
            + f" ({memory[0]['peak_kind']})"
        )
        self.metrics.close()
        if self.world > 1:
            self.log(parallel.check_replicas(self.layout, all_ranks(parallel.replica_digests(self.parallel))))
        if self.args.sample_chars:  # every process takes part: a split model's forward is a collective
            self.log("sample:\n" + self.sample(self.args.sample_chars))

    def sample(self, count):
        self.parallel.train(False)
        idx = torch.tensor([[self.corpus.start_id()]], device=self.device)
        gen = torch.Generator().manual_seed(self.args.seed)
        with self.autocast():
            out = self.parallel.generate(idx, count, top_k=40, generator=gen)
        self.parallel.train(True)
        return self.corpus.decode(out[0, 1:].tolist())
