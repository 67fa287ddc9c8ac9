"""The text to train on, as a tensor of character ids, and the batches drawn from it.

Sources (--data): `stdlib` (the default) is the Python standard library's own source, present wherever
Python is; a path to a UTF-8 text file; an http(s) URL, downloaded once into the cache folder.
"""

import contextlib
import fcntl
import hashlib
import os
import re
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch
from checkpoint import atomic_write

VAL_FRACTION = 0.1  # the last tenth of the text is held out for validation
# folders of the standard library that are not its source: tests, and packages installed into it
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
NOT_PRINTABLE = re.compile(r"[^\x20-\x7e\n]")


class DataError(ValueError):
    """Input the run cannot train on; the message names it."""


def stdlib_text():
    """Every *.py file of the standard library outside test folders, in path order: tabs become four
    spaces, and only printable ASCII and newlines are kept."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for path in sorted(root.rglob("*.py")):
        if SKIP_DIRS & set(path.relative_to(root).parts[:-1]):
            continue
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        parts.append(NOT_PRINTABLE.sub("", text.replace("\t", "    ")))
    return "".join(parts)


def encode(text):
    """Character ids: the vocabulary is the text's distinct characters, sorted."""
    codes = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32)
    vocab = torch.unique(codes)
    ids = torch.searchsorted(vocab, codes)
    dtype = torch.int16 if len(vocab) <= 2**15 else torch.int32
    return ids.to(dtype), "".join(map(chr, vocab.tolist()))


def decode(ids, vocab):
    return "".join(vocab[i] for i in ids)


@contextlib.contextmanager
def file_lock(path, timeout):
    """Hold an exclusive lock on path, so that one process builds a cached file while the others wait."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise DataError(
                        f"waited {timeout:.0f} s for {path}, held by another process preparing the data"
                    ) from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)  # releases the lock


def download(url, dest, timeout):
    """Fetch url into dest. Every network wait is bounded by timeout, and so is the whole transfer."""
    deadline = time.monotonic() + timeout

    def write(f):
        with urllib.request.urlopen(url, timeout=timeout) as response:
            while chunk := response.read(1 << 20):
                f.write(chunk)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the download took longer than {timeout:g} s")

    try:
        atomic_write(dest, write)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise DataError(f"--data {url}: cannot download it within {timeout:g} s: {reason}") from None


def cached_stdlib(cache_dir, lock_timeout):
    """The standard library corpus, built by the first process to get here and cached for all others."""
    version = f"{sys.implementation.name}-{sys.version_info.major}.{sys.version_info.minor}"
    key = hashlib.sha256(sysconfig.get_paths()["stdlib"].encode()).hexdigest()[:8]
    path = cache_dir / f"stdlib-{version}-{key}.pt"
    with file_lock(path.with_suffix(".lock"), lock_timeout):
        if not path.exists():
            ids, vocab = encode(stdlib_text())
            atomic_write(path, lambda f: torch.save({"ids": ids, "vocab": vocab}, f))
    corpus = torch.load(path, weights_only=True)
    return corpus["ids"], corpus["vocab"]


def read_text(path, source):
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"--data {source}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"--data {source}: cannot read it as UTF-8 text: {exc}") from None


def load_corpus(source, cache_dir, timeout):
    """(ids, vocab) for --data: `stdlib`, a text file, or an http(s) URL (cached by its address)."""
    cache_dir = Path(cache_dir).expanduser()
    if source == "stdlib":
        return cached_stdlib(cache_dir, timeout)
    if re.match(r"https?://", source):
        path = cache_dir / f"url-{hashlib.sha256(source.encode()).hexdigest()[:16]}.txt"
        with file_lock(path.with_suffix(".lock"), timeout):
            if not path.exists():
                download(source, path, timeout)
        text = read_text(path, source)
    elif "://" in source:
        raise DataError(f"--data {source}: only http:// and https:// addresses can be downloaded")
    else:
        text = read_text(source, source)
    return encode(text)


def split(ids, block_size):
    """Train and validation parts (the last VAL_FRACTION), each long enough for one sample."""
    cut = int(len(ids) * (1 - VAL_FRACTION))
    train, val = ids[:cut], ids[cut:]
    need = block_size + 1
    if len(val) < need:
        raise DataError(
            f"the corpus has {len(ids)} characters: its validation part ({len(val)}) is shorter than one "
            f"sample of block_size + 1 = {need}; give a longer text or a smaller --block_size"
        )
    return train, val


def unigram_entropy(ids, vocab_size):
    """Cross-entropy in nats of predicting every character from the characters' frequencies alone."""
    counts = torch.bincount(ids.long(), minlength=vocab_size).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def step_offsets(seed, step, count, data_len, block_size):
    """Start offsets of one step's global batch, a function of (seed, step) alone: the order does not
    depend on the number of processes, and resuming at a step needs nothing but the step."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, data_len - block_size, (count,), generator=gen)


def gather(data, offsets, block_size):
    """Inputs and targets (shifted by one) for the given offsets, indexed where data lives (the GPU)."""
    idx = offsets.to(data.device, non_blocking=True)[:, None] + torch.arange(
        block_size + 1, device=data.device
    )
    chunk = data[idx].long()
    return chunk[:, :-1], chunk[:, 1:]
