"""The sizes a run starts from (--model): a model shape and the training settings that suit it. Any
option given on the command line overrides a preset's value; add a size here to name it."""

PRESETS = {
    # about 0.8M parameters: a few thousand steps of this learn Python's look on two CPU cores
    "cpu": {
        **dict(n_layer=4, n_head=4, n_embd=128, block_size=128, dropout=0.0, bias="no"),
        **dict(tokenizer="char", batch_size=16, lr=1e-3, warmup_steps=20, max_steps=300),
        **dict(eval_every=100, eval_samples=256, log_every=10),
    },
    # about 10.8M parameters, one GPU for minutes
    "mini": {
        **dict(n_layer=6, n_head=6, n_embd=384, block_size=256, dropout=0.1, bias="no"),
        **dict(tokenizer="char", batch_size=64, lr=1e-3, warmup_steps=100, max_steps=3000),
        **dict(eval_every=250, eval_samples=2048, log_every=10),
    },
    # GPT-2 small's shape (12 layers, 12 heads, width 768, context 1024) and its
    # 50257-token byte-level BPE vocabulary: 124M parameters (85M with --tokenizer char)
    "gpt2": {
        **dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, dropout=0.0, bias="yes"),
        **dict(tokenizer="bpe", batch_size=16, lr=6e-4, warmup_steps=200, max_steps=2000),
        **dict(eval_every=250, eval_samples=1024, log_every=10),
    },
}
WARMUP_FRACTION = 0.1  # a preset's warm-up takes at most this share of --max_steps: not all warm-up
