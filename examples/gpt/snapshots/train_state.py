"""The trainer's state into and out of a snapshot (checkpoint.py writes and reads the
files): what a resumed run needs besides the weights and the optimizer state, and what it
says when it changes the schedule."""

from dataclasses import asdict, replace

import parallel
import torch
from model import GPT, GPTConfig, optimizer_groups
from processes import all_ranks

from snapshots import checkpoint, hf

# The Config fields that make the model's shape (GPTConfig's, but its vocabulary, the corpus's, and
# --bias, yes or no)
MODEL_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "dropout", "activation")
# The run's learning-rate schedule and length, kept
# in snapshots: a resumed run says what it changes.
SCHEDULE_KEYS = ("lr", "min_lr", "warmup_steps", "decay_steps", "max_steps", "weight_decay")


def rng_state(device):
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def save(trainer, rng):
    """A collective: every process writes its parts, the leader the rest
    (checkpoint.save), with the random states `rng` taken at the start of step
    trainer.step. The data position is the step itself."""
    t, a = trainer, trainer.args
    extra = {
        "config": snapshot_config(a, t.corpus),
        "tokenizer": None if t.corpus.tokenizer is None else t.corpus.tokenizer.to_str(),
        "scaler": t.scaler.state_dict(),
        "step": t.step,
        "seed": a.seed,
        "global_batch": a.global_batch,
        "schedule": {key: getattr(a, key) for key in SCHEDULE_KEYS},
        "rng": all_ranks(rng),  # one entry per process
        "layout": t.layout.as_dict(),  # whose processes drew those streams
    }
    optimizer = parallel.local_optimizer(t.optimizer)
    checkpoint.save(a.snapshot_path, t.raw, optimizer, extra, t.layout.leader, a.keep)


def restore(trainer, snapshot):
    """A collective: the snapshot's state into the trainer, each process reading its own parts."""
    t, a = trainer, trainer.args
    optimizer = parallel.local_optimizer(t.optimizer)
    if "shards" not in snapshot:  # a single file (--init_from): made this run's first snapshot
        snapshot["shards"] = checkpoint.import_file(a.snapshot_path, snapshot, t.layout.leader)
    checkpoint.load_shards(snapshot["shards"], t.raw, optimizer)
    t.scaler.load_state_dict(snapshot["scaler"])
    t.step = int(snapshot["step"])
    rng = snapshot["rng"]
    # same processes and layout: each continues its own dropout stream
    if (len(rng), snapshot.get("layout")) == (t.world, t.layout.as_dict()):
        torch.set_rng_state(rng[t.rank]["cpu"])
        if rng[t.rank]["cuda"] is not None and t.device.type == "cuda":
            torch.cuda.set_rng_state(rng[t.rank]["cuda"], t.device)
    else:
        torch.manual_seed(a.seed + 1 + t.dp_rank + t.step * t.dp_world)
    before = snapshot.get("schedule", {})
    if "decay_steps" in before and not a.decay_given:  # the cosine keeps the snapshot's end
        t.args = a = replace(a, decay_steps=before["decay_steps"])
    compare_schedule(a, before, t.log)
    if (snapshot["seed"], snapshot["global_batch"]) != (a.seed, a.global_batch):
        t.log(
            f"note: the snapshot ran with seed {snapshot['seed']} and global batch "
            f"{snapshot['global_batch']}; this run has {a.seed} and {a.global_batch}"
        )


def compare_schedule(a, before, log):
    """Say what this run changes from the snapshot's. The cosine keeps its end (decay_steps) unless
    --decay_steps is given: raising --max_steps then goes on at min_lr instead of reshaping it."""
    changed = [
        f"{key} {before[key]:g} -> {getattr(a, key):g}" for key in before if before[key] != getattr(a, key)
    ]
    if changed:
        log(
            f"note: changed since the snapshot: {', '.join(changed)}. The cosine ends at step "
            f"{a.decay_steps} (--decay_steps moves it); AdamW's weight decay and betas stay as saved"
        )


def model_config(args, vocab_size):
    shape = {key: getattr(args, key) for key in MODEL_KEYS}
    return GPTConfig(vocab_size=vocab_size, bias=args.bias != "no", **shape)


def snapshot_config(args, corpus):
    """What must match for a snapshot to load into
    this run: the model's shape and its tokenizer."""
    cfg = asdict(model_config(args, corpus.vocab_size))
    del cfg["dropout"]  # may change between runs
    cfg["tokenizer_sha256"] = corpus.digest
    cfg["qkv_layout"] = "per_head"  # the fused q, k, v outputs head by head (before: all q, all k, all v)
    cfg["padded_vocab"] = model_config(args, corpus.vocab_size).padded_vocab  # (before: not padded)
    return cfg


def from_hf(args, corpus):
    """A single-file snapshot's state (as export.py writes one) of a Hugging Face GPT-2 folder: its
    weights in this run's model, a fresh AdamW, step 0; refused (HFError) when its vocabulary is
    not the corpus's."""
    vocab = hf.read_config(args.init_from)["vocab_size"]
    if vocab != corpus.vocab_size:
        raise hf.HFError(
            f"--init_from {args.init_from} has a vocabulary of {vocab} tokens, --data {corpus.vocab_size}: "
            f"prepare the data with its tokenizer (prepare.py --tokenizer {args.init_from}/tokenizer.json)"
        )
    model = GPT(model_config(args, corpus.vocab_size))
    model.init_weights(args.seed)  # the padding rows and the head's frozen bias; the rest is overwritten
    hf.load_into(args.init_from, model)
    optimizer = torch.optim.AdamW(optimizer_groups(model, args.weight_decay), lr=args.lr)
    model_state, optimizer_state = checkpoint.whole_state(model, optimizer)
    return {
        "config": snapshot_config(args, corpus),
        "tokenizer": None if corpus.tokenizer is None else corpus.tokenizer.to_str(),
        "scaler": {},  # a LossScaler off: no fp16 loss scale to keep
        "step": 0,
        "seed": args.seed,
        "global_batch": args.global_batch,
        "schedule": {},
        "rng": [],
        "model": model_state,
        "optimizer": optimizer_state,
    }


class DeferredSave:
    """A snapshot due after step s waits for step s + 1's checks: it is written only when that
    step's loss is finite, before its update, holding the state that step started from. No snapshot
    holds weights that gave a non-finite loss."""

    def __init__(self, every):
        self.every, self.due = every, False

    def after(self, step):
        self.due = self.due or step % self.every == 0

    def take(self, loss_ok):
        """Whether to write the due snapshot now."""
        now, self.due = self.due and loss_ok, self.due and not loss_ok
        return now
