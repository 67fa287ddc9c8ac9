"""The step and the loop: precision, accumulation, the checks (failures/guards.py), evaluation and
snapshots. parallel/ splits the model over the processes: the trainer sees a Parallel."""

import math
import time
from contextlib import nullcontext

import data
import parallel
import torch
import torch.distributed as dist
from failures import guards
from model import GPT, choose_attention, flops_per_token, optimizer_groups, parameter_count
from observability import memory, metrics
from observability.traces import StepProfiler
from processes import all_ranks
from snapshots import train_state
from snapshots.train_state import model_config
from torch.distributed.tensor.experimental import implicit_replication


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
        self.metrics = metrics.Metrics(args.metrics_path, self.leads, not args.no_tensorboard)
        self.log = self.metrics.log
        self.dp_rank, self.dp_world = layout.dp_rank(rank), layout.dp
        self.corpus = corpus
        # memory-mapped shards: each process reads the windows of its share of every batch, no more
        self.train_data, self.val_data = corpus.train, corpus.val
        if args.in_memory:  # or the whole corpus on the device, indexed there (for comparison)
            self.train_data, self.val_data = corpus.train.long().to(device), corpus.val.long().to(device)
        self.dtype = parallel.resolve_dtype(args.dtype, device)
        with torch.device("meta"):  # no storage: each process materialises its own part below
            model = GPT(model_config(args, corpus.vocab_size))
        choose_attention(model, args.attention)
        self.params = parameter_count(model, non_embedding=False)
        self.flops_per_token = flops_per_token(model)
        self.llmc_flops_per_token = flops_per_token(model, llmc=True)  # MFU as llm.c counts it too
        param_dtype = torch.bfloat16 if self.dtype == torch.bfloat16 else None  # FSDP all-gathers
        self.parallel = parallel.parallelize(model, layout, args, device, param_dtype)
        self.raw = self.parallel.module  # this process's part of the GPT
        groups = optimizer_groups(self.raw, args.weight_decay)
        self.optimizer = parallel.make_optimizer(groups, layout, self.parallel.mesh, device)
        self.scaler = guards.LossScaler(self.dtype == torch.float16, args.loss_scale, device=device)
        self.step = 0
        self.checks = guards.Checks(args.skip_nonfinite, self.scaler.enabled, self.log)
        # dropout: a stream per share of the batch; the processes of one share (tp, pp) draw alike
        torch.manual_seed(args.seed + 1 + self.dp_rank)
        if snapshot is not None:
            train_state.restore(self, snapshot)
        self.peak = metrics.peak_flops(args, device)
        # each process's pace in data and forward passes; --slow_factor 0: nothing timed
        self.times = metrics.RankTimes(device) if args.slow_factor else nullcontext()
        self.parallel.forward_timer = self.times

    def save(self, rng):
        """A collective: train_state.save. Returns the seconds it took."""
        start = time.perf_counter()
        train_state.save(self, rng)
        self.log(f"saved {self.args.snapshot_path} at step {self.step}")
        return time.perf_counter() - start

    # ---- one step ----------------------------------------------------------------------------
    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    def train_step(self, stop):
        """Forward and backward over the micro-batches, then the checks (guards.verdict), no update
        yet: the verdict, a tensor on the device."""
        a = self.args
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.args, self.step)
        offsets = data.step_offsets(a.seed, self.step, a.global_batch, len(self.train_data), a.block_size)
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(a.grad_accum):
            # this process's slice of the step's global batch
            start = (self.dp_rank * a.grad_accum + micro) * a.batch_size
            mine = offsets[start : start + a.batch_size]
            with self.times:  # its own pace: the data, and the forward pass in step()
                x, y = data.gather(self.train_data, mine, a.block_size, self.device)
            # gradients add up locally; the last micro-batch's backward reduces them over processes
            with self.parallel.sync(micro == a.grad_accum - 1), self.autocast():
                loss_sum += self.parallel.step(x, y, self.backward)
        self.scaler.unscale(self.raw.parameters())  # clip and check the true gradients
        norm = parallel.clip_grad_norm_(self.parallel, a.grad_clip or math.inf)
        return guards.verdict(loss_sum / a.grad_accum, norm, stop)

    def update(self, verdict):
        """The optimizer step, decided on the device: fused AdamW skips it where the verdict says a
        loss or a gradient is not finite (its found_inf), and fp16's loss scale halves or grows."""
        skip = guards.skip(verdict)
        parallel.local_optimizer(self.optimizer).found_inf = skip
        with implicit_replication():  # found_inf beside DTensor parameters: alike on every process
            self.optimizer.step()
        self.scaler.update(skip)
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1

    def reads(self, step):
        """Whether the host reads the checks at this step (1-based): a log, evaluation or end."""
        a = self.args
        return step % a.log_every == 0 or step % a.eval_every == 0 or step == a.max_steps

    def backward(self, loss):
        self.scaler.scale(loss / self.args.grad_accum).backward()

    @torch.no_grad()
    def evaluate(self):
        """Mean validation loss over a fixed set of sequences, shared out among the data shares."""
        a = self.args
        self.parallel.train(False)
        offsets = data.step_offsets(a.seed, -1, a.eval_samples, len(self.val_data), a.block_size)
        loss_sum, count = torch.zeros((), device=self.device, dtype=torch.float64), 0
        mine = offsets[self.dp_rank :: self.dp_world]
        # every process runs as many forwards (each gathers sharded weights): the largest share's
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
        if dist.is_initialized():  # a share's processes (tp, pp) add the same terms: mean holds
            dist.all_reduce(totals)
        self.parallel.train(True)
        return (totals[0] / totals[1]).item()

    # ---- the run -----------------------------------------------------------------------------
    def train(self, stop):
        """Steps until --max_steps, or until `stop` (preempt.StopRequest) is set on some process:
        then, at the next step that reads the checks (within --log_every steps), the state at its
        start is saved and False returned. A snapshot due after step s is written only once the
        loss of step s + 1 shows its weights sound, before that step's update: no snapshot holds
        weights that gave a non-finite loss. The final validation loss checks the last one."""
        a = self.args
        self.log(metrics.opening(self))
        if self.corpus.unigram is not None:
            self.log(f"unigram entropy of the training text: {self.corpus.unigram:.4f}")
        meter = memory.MemoryMeter(self.raw, self.optimizer, self.parallel)
        history_path = a.memory_snapshot and f"{a.memory_snapshot}.rank{self.rank}"
        history = memory.MemoryHistory(history_path, self.device)
        profiler = a.profile_steps and StepProfiler(a.profile_steps, a.profile_dir, self.rank, self.device)
        save, steps, clock, norm = train_state.DeferredSave(a.save_every), 0, time.perf_counter(), math.nan
        while self.step < a.max_steps:
            if profiler:
                profiler.at_step(self.step + 1)
            reads = meter.active = save.due or self.reads(self.step + 1)
            rng = train_state.rng_state(self.device) if reads else None  # what a save holds
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
                metrics.log_interval(self, self.checks.mean_loss(), norm, steps, time.perf_counter() - clock)
                steps, clock = 0, time.perf_counter()
            clock += self.evaluate_and_save(last)
            save.after(self.step)
        if profiler:
            profiler.finish()
        history.dump()
        self.finish(meter)
        return True

    def evaluate_and_save(self, last):
        """The validation loss when due, and the last snapshot: the seconds they took, which stay
        out of the throughput."""
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

    def finish(self, meter):
        memory.report(meter, self.device, self.metrics, self.step)
        self.metrics.close()
        if self.world > 1:
            self.log(parallel.check_replicas(self.layout, all_ranks(parallel.replica_digests(self.parallel))))
        if self.args.sample_chars:  # every process: a split model's forward is a collective
            self.log("sample:\n" + self.sample(self.args.sample_chars))

    def sample(self, count):
        self.parallel.train(False)
        idx = torch.tensor([[self.corpus.start_id()]], device=self.device)
        gen = torch.Generator().manual_seed(self.args.seed)
        with self.autocast():
            out = self.parallel.generate(idx, count, top_k=40, generator=gen)
        self.parallel.train(True)
        return self.corpus.decode(out[0, 1:].tolist())
