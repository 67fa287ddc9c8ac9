"""Hugging Face's GPT-2 format, as transformers' GPT2LMHeadModel reads and writes it: the model out
to such a folder (export.py --format hf; needs transformers), and such a folder's weights in, to
fine-tune from (train.py --init_from DIR; needs safetensors, which torch's ecosystem ships with).

The layouts differ in three ways, converted both ways here: GPT-2's Conv1D layers hold the
transpose of our Linear weights; its fused attention projection gives q for every head, then k,
then v, where ours gives each head's q, k and v together; its vocabulary has no padding rows. Its
biases are always there (zeros for a model without them), and its activation is recorded: GPT-2's
own is the tanh approximation of GELU.
"""

import json
import os
import shutil
from pathlib import Path

import tokenizer as tok
import torch

# GPT-2's name of each layer of a block: ours
LAYERS = {"ln_1": "ln1", "ln_2": "ln2", "attn.c_attn": "attn.qkv", "attn.c_proj": "attn.proj"}
LAYERS |= {"mlp.c_fc": "mlp.fc", "mlp.c_proj": "mlp.proj"}
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh"}  # GPT-2's names: ours


class HFError(ValueError):
    """A folder that is not a GPT-2 this trainer can start from; the message names it."""


def regroup(t, heads, by_kind):
    """The fused q, k, v rows (or biases) of `heads` heads: head by head (ours) to q, k, v each for
    every head (GPT-2's), or back."""
    shape = (heads, 3) if by_kind else (3, heads)
    return t.reshape(*shape, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def state_of(model):
    """The model's weights under GPT-2's names and layouts."""
    cfg = model.cfg

    def bias(module, size):
        return module.bias if module.bias is not None else torch.zeros(size)

    state = {"wte.weight": model.tok_emb.weight[: cfg.vocab_size], "wpe.weight": model.pos_emb.weight}
    for i, block in model.blocks.items():
        for theirs, ours in LAYERS.items():
            module = block.get_submodule(ours)
            weight, b = module.weight, bias(module, module.weight.shape[0])
            if ours == "attn.qkv":
                weight, b = regroup(weight, cfg.n_head, True), regroup(b, cfg.n_head, True)
            if isinstance(module, torch.nn.Linear):
                weight = weight.T
            state[f"h.{i}.{theirs}.weight"], state[f"h.{i}.{theirs}.bias"] = weight, b
    state["ln_f.weight"], state["ln_f.bias"] = model.ln_f.weight, bias(model.ln_f, cfg.n_embd)
    return {f"transformer.{key}": value.detach().contiguous() for key, value in state.items()}


def save(state, model, out):
    """out as a Hugging Face GPT-2 folder (config.json, model.safetensors; a BPE snapshot's
    tokenizer as tokenizer.json and its config), written beside out and renamed into place."""
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    cfg = model.cfg
    tokenizer = (
        tok.from_str(state["tokenizer"], "the snapshot's tokenizer") if state.get("tokenizer") else None
    )
    end = tokenizer.start_id() if tokenizer is not None and tokenizer.kind == "bpe" else None
    activation = {ours: theirs for theirs, ours in ACTIVATIONS.items()}[cfg.activation]
    config = GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
        n_head=cfg.n_head, activation_function=activation, layer_norm_epsilon=1e-5, resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout, bos_token_id=end, eos_token_id=end,
        tie_word_embeddings=True,
    )  # fmt: skip
    with torch.device("meta"):  # no initial values: every weight is the snapshot's
        hf = GPT2LMHeadModel(config)
    missing, unexpected = hf.load_state_dict(state_of(model), strict=False, assign=True)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.tie_weights()
    tmp = f"{out}.tmp.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        hf.save_pretrained(tmp)
        if tokenizer is not None and tokenizer.kind == "bpe":
            special = dict(bos_token=tok.EOT, eos_token=tok.EOT, unk_token=tok.EOT)
            fast = PreTrainedTokenizerFast(
                tokenizer_object=tokenizer.hf, model_max_length=cfg.block_size, **special
            )
            fast.save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def is_folder(path):
    return path is not None and os.path.isfile(os.path.join(path, "config.json"))


def read_config(folder):
    """The model options a GPT-2 folder's config.json stands for: n_layer, n_head, n_embd,
    block_size (its n_positions), activation, bias (GPT-2 has them), and its vocab_size."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
        if config.get("model_type") != "gpt2":
            raise HFError(f"its model_type is {config.get('model_type')!r}, not 'gpt2'")
        if config.get("n_inner") not in (None, 4 * config["n_embd"]):
            raise HFError(f"its MLP is {config['n_inner']} wide, not 4 x n_embd")
        if config.get("activation_function", "gelu_new") not in ACTIVATIONS:
            raise HFError(f"its activation {config['activation_function']!r} is neither gelu nor gelu_new")
        return {
            "n_layer": config["n_layer"], "n_head": config["n_head"], "n_embd": config["n_embd"],
            "block_size": config["n_positions"], "vocab_size": config["vocab_size"],
            "activation": ACTIVATIONS[config.get("activation_function", "gelu_new")], "bias": "yes",
        }  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise HFError(f"--init_from {folder}: not a GPT-2 folder this trainer reads: {exc}") from None


def load_into(folder, model):
    """A GPT-2 folder's weights (model.safetensors) into model, a GPT of its shape: the
    vocabulary's rows (the padding rows stay as they are), every block, the final norm."""
    from safetensors.torch import load_file

    cfg = model.cfg
    try:
        weights = load_file(Path(folder) / "model.safetensors")
    except Exception as exc:
        raise HFError(f"--init_from {folder}: cannot read model.safetensors: {exc}") from None
    weights = {key.removeprefix("transformer."): value for key, value in weights.items()}
    ours = {"tok_emb.weight": "wte.weight", "pos_emb.weight": "wpe.weight"}
    ours |= {"ln_f.weight": "ln_f.weight", "ln_f.bias": "ln_f.bias"}
    for i in map(str, range(cfg.n_layer)):
        for theirs, name in LAYERS.items():
            for kind in ("weight", "bias"):
                ours[f"blocks.{i}.{name}.{kind}"] = f"h.{i}.{theirs}.{kind}"
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, key in ours.items():
            value = weights[key]
            if name not in params:  # a model without biases (--bias no): they must be zeros
                if value.any():
                    message = f"its {key} is not zero: train it with --bias yes"
                    raise HFError(f"--init_from {folder}: {message}")
                continue
            if value.dim() == 2 and name.startswith("blocks."):  # a Conv1D's weight
                value = value.T
            if ".attn.qkv." in name:
                value = regroup(value, cfg.n_head, False)
            # the vocabulary's rows (ours has padding rows
            # after them); the first block_size positions
            rows = min(len(value), len(params[name]))
            params[name][:rows].copy_(value[:rows])
