"""Tokenizers, each saved as one JSON file whose SHA-256 names it: a character tokenizer (the
text's distinct characters, sorted), or a byte-level BPE trained with Hugging Face `tokenizers`
(GPT-2's scheme: any text encodes, nothing is unknown). Only BPE needs the `tokenizers` package,
imported when used."""

import hashlib
import json

import torch

EOT = "<|endoftext|>"  # BPE: ends every document, as in GPT-2


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used; the message names it."""


class CharTokenizer:
    kind = "char"

    def __init__(self, vocab):
        self.vocab = vocab
        self.vocab_size = len(vocab)
        self._index = {ch: i for i, ch in enumerate(vocab)}

    @classmethod
    def train(cls, texts, vocab_size=None):
        """The distinct characters of texts (an iterable, read once), sorted."""
        chars = set()
        for text in texts:
            chars.update(text)
        return cls("".join(sorted(chars)))

    def encode(self, text):
        """A tensor of ids; every character of text must be in the vocabulary (in any order)."""
        codes = utf32(text)
        vocab, order = utf32(self.vocab).sort()
        at = torch.searchsorted(vocab, codes).clamp_(max=len(vocab) - 1)
        if len(codes) and not bool((vocab[at] == codes).all()):
            missing = chr(int(codes[vocab[at] != codes][0]))
            raise TokenizerError(f"the character {missing!r} is not in the tokenizer's vocabulary")
        return order[at]

    def decode(self, ids):
        return "".join(self.vocab[i] for i in ids)

    def to_str(self):
        return json.dumps({"type": "char", "vocab": self.vocab}, ensure_ascii=False)

    def start_id(self):
        """The token a sample starts from: a line break where there is one."""
        return self._index.get("\n", 0)


class BPETokenizer:
    kind = "bpe"

    def __init__(self, hf):
        self.hf = hf
        self.vocab_size = hf.get_vocab_size()

    @classmethod
    def train(cls, texts, vocab_size):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        hf = Tokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is unknown
            show_progress=False,
        )
        hf.train_from_iterator(texts, trainer=trainer)  # texts: an iterable, read once
        return cls(hf)

    def encode(self, text):
        return torch.tensor(self.hf.encode(text).ids, dtype=torch.int64)

    def decode(self, ids):
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def to_str(self):
        return self.hf.to_str()

    def start_id(self):
        return self.hf.token_to_id(EOT)


KINDS = {"char": CharTokenizer, "bpe": BPETokenizer}


def utf32(text):
    return torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32)


def digest(text):
    """The tokenizer's name in manifests and snapshots:
    the first 16 hex digits of its file's SHA-256."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def from_str(text, source):
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{source}: not a tokenizer file (not JSON: {exc})") from None
    if isinstance(spec, dict) and spec.get("type") == "char" and isinstance(spec.get("vocab"), str):
        return CharTokenizer(spec["vocab"])
    if isinstance(spec, dict) and "model" in spec:
        from tokenizers import Tokenizer

        try:
            return BPETokenizer(Tokenizer.from_str(text))
        except Exception as exc:
            raise TokenizerError(f"{source}: not a tokenizer file ({exc})") from None
    raise TokenizerError(f"{source}: not a tokenizer file (neither a char nor a tokenizers JSON)")


def load(path):
    """(tokenizer, its digest) from a file written by save()."""
    try:
        text = open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"cannot read the tokenizer {path}: {exc}") from None
    return from_str(text, path), digest(text)
