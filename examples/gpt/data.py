"""The tokens to train on, memory-mapped from shards on disk, and the batches drawn from them.

Sources (--data): a folder that prepare.py wrote (its manifest.json names the tokenizer and the
shards); a folder holding nanoGPT's train.bin and val.bin (uint16, read as they are); or text,
prepared into the cache folder once (by the first process to get there) with --tokenizer: `stdlib`
(the default) is the Python standard library's own source, present wherever Python is; a UTF-8 text
file or a folder of them; an http(s) URL, downloaded once into the cache folder.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import pickle
import re
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import prepare
import tokenizer as tok
import torch
from snapshots.checkpoint import atomic_write


class DataError(ValueError):
    """Input the run cannot train on; the message names it."""


@contextlib.contextmanager
def file_lock(path, timeout, what):
    """Hold an exclusive lock on path while this process builds `what`; the others wait. The holder
    touches the lock file every second, and a waiter gives up only after `timeout` seconds without
    a touch: it waits as long as the holder lives, however long building takes. A DataError raised
    while holding it is left in path.failed for those that waited, which end with the same message
    instead of trying again."""
    path.parent.mkdir(parents=True, exist_ok=True)
    failed = path.with_suffix(".failed")
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        started, waited = time.time(), False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.time() - max(os.fstat(fd).st_mtime, started) > timeout:
                    raise DataError(
                        f"waited for {what}: the process building it (holding {path}) gave no sign of life "
                        f"for {timeout:.0f} s"
                    ) from None
                if not waited:
                    print(f"waiting for another process to build {what}", flush=True)
                waited = True
                time.sleep(0.2)
        if waited and failed.exists() and failed.stat().st_mtime >= started:
            raise DataError(failed.read_text())
        failed.unlink(missing_ok=True)
        alive = threading.Event()
        beat = threading.Thread(target=touch_until, args=(path, alive), daemon=True)
        beat.start()
        try:
            yield
        except DataError as exc:
            message = str(exc)
            atomic_write(failed, lambda f: f.write(message.encode()))
            raise
        finally:
            alive.set()
            beat.join()
    finally:
        os.close(fd)  # releases the lock


def touch_until(path, done):
    """Set path's modification time now, and every second until done is set."""
    while True:
        os.utime(path)
        if done.wait(1):
            return


def download(url, dest, timeout):
    """Fetch url into dest. Every network wait is
    bounded by timeout, and so is the whole transfer."""
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


class Corpus:
    """The train and validation tokens, memory-mapped from their shards (no process reads them
    whole), the tokenizer they were made with (None for nanoGPT's shards without one), its digest,
    and the data's (data_digest): what the processes of a run compare before they train."""

    def __init__(self, folder, manifest, tokenizer, digest):
        self.folder, self.manifest, self.tokenizer, self.digest = folder, manifest, tokenizer, digest
        self.vocab_size = manifest["tokenizer"]["vocab_size"]
        self.data_digest = sampled_digest(folder, manifest, digest)
        self.unigram = manifest.get("unigram_entropy")
        dtype = {"uint16": torch.uint16, "uint32": torch.uint32}[manifest["dtype"]]
        self.train, self.val = (
            map_ids(folder / s["file"], s["tokens"], dtype)
            for s in (manifest["shards"]["train"], manifest["shards"]["val"])
        )

    def check(self, block_size):
        """Each part long enough for one sample of block_size + 1 tokens."""
        need = block_size + 1
        for name, part in (("validation", self.val), ("training", self.train)):
            if len(part) < need:
                raise DataError(
                    f"{self.folder}: its {name} part ({len(part)} tokens) is shorter than one sample of "
                    f"block_size + 1 = {need}; give a longer text or a smaller --block_size"
                )

    def decode(self, ids):
        """Text, or the ids themselves without a tokenizer."""
        return " ".join(map(str, ids)) if self.tokenizer is None else self.tokenizer.decode(ids)

    def start_id(self):
        return 0 if self.tokenizer is None else self.tokenizer.start_id()


BLOCKS, BLOCK = 16, 1 << 16  # each shard's part read at start-up: 16 blocks of 64 KiB


def sampled_digest(folder, manifest, tokenizer_digest):
    """The data as it is on disk now: prepare.py's digest of every byte where the manifest
    holds one (nanoGPT's shards and older folders have none), the vocabulary, the tokenizer,
    and each shard's size and 16 blocks spread evenly from its start to its end, read at
    start-up; never the whole corpus, which may be larger than memory. A shard changed after
    it was prepared differs where a block falls: at its ends, a sixteenth of its middle, and
    all of a shard under 1 MiB."""
    vocab = manifest["tokenizer"]["vocab_size"]
    head = f"{manifest.get('data_sha256')} {vocab} {tokenizer_digest}\n"
    digest = hashlib.sha256(head.encode())
    for name in prepare.SHARDS:
        shard = manifest["shards"][name]
        digest.update(f"{name} {shard['bytes']}\n".encode())
        last = max(shard["bytes"] - BLOCK, 0)  # the last block's start
        with open(folder / shard["file"], "rb") as f:
            for start in sorted({last * i // (BLOCKS - 1) for i in range(BLOCKS)}):  # once each
                f.seek(start)
                digest.update(f.read(BLOCK))
    return digest.hexdigest()


def disagreement(found):
    """The sentence saying which processes would train on which data, from (data digest, host) of
    every process in rank order (rank 0's data first named as the one the others differ from); None
    when every process has the same."""
    groups = {}  # digest: (ranks, hosts)
    for rank, (digest, host) in enumerate(found):
        ranks, hosts = groups.setdefault(digest, ([], []))
        ranks.append(rank)
        if host not in hosts:
            hosts.append(host)
    if len(groups) == 1:
        return None
    (digest, (ranks, hosts)), *others = groups.items()
    differ = ", ".join(f"ranks {r} (host {', '.join(h)}) have data digest {d[:12]}" for d, (r, h) in others)
    return f"{differ} where ranks {ranks} (host {', '.join(hosts)}) have {digest[:12]}"


def map_ids(path, tokens, dtype):
    """The first `tokens` ids of a shard, mapped, not read: pages are read when a window touches
    them. shared=False: a private mapping, nothing is ever written back."""
    if tokens == 0:
        return torch.empty(0, dtype=dtype)
    return torch.from_file(str(path), shared=False, size=tokens, dtype=dtype)


def open_shards(folder, vocab_size=None):
    """The Corpus of a folder that prepare.py wrote, or of nanoGPT's train.bin and val.bin (uint16,
    with GPT-2's vocabulary unless vocab_size, or a tokenizer.json or nanoGPT's meta.pkl beside
    them, says otherwise; those two also decode samples)."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / prepare.MANIFEST).read_text())
        if "incomplete" in manifest:  # prepare.py was stopped while it wrote the folder
            raise DataError(f"--data {folder}: {manifest['incomplete']}: run it again")
        spec = manifest["tokenizer"]
        vocab = spec["vocab_size"]
        dtype = prepare.DTYPES[manifest["dtype"]]
        shards = [manifest["shards"][name] for name in prepare.SHARDS]
    except FileNotFoundError:
        manifest = None
    except DataError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"--data {folder}: its {prepare.MANIFEST} cannot be read: {exc}") from None
    if manifest is None:
        return open_nanogpt(folder, vocab_size)
    if not isinstance(vocab, int) or not 0 < vocab <= 2 ** (8 * dtype.itemsize):  # uint16: ids below 65536
        raise DataError(
            f"--data {folder}: {prepare.MANIFEST} says a vocabulary of {vocab} tokens in "
            f"{manifest['dtype']} shards, whose ids stop at {2 ** (8 * dtype.itemsize) - 1}"
        )
    for shard in shards:
        path = folder / shard["file"]
        size = path.stat().st_size if path.is_file() else None
        if size != shard["bytes"] or size != shard["tokens"] * dtype.itemsize:
            raise DataError(
                f"--data {folder}: {prepare.MANIFEST} does not match its shards: {shard['file']} has "
                f"{'no file' if size is None else f'{size} bytes'}, the manifest says {shard['tokens']} "
                f"{manifest['dtype']} tokens ({shard['bytes']} bytes)"
            )
    try:
        tokenizer, digest = tok.load(folder / spec["file"])
    except tok.TokenizerError as exc:
        raise DataError(f"--data {folder}: {exc}") from None
    if digest != spec["sha256"]:
        raise DataError(
            f"--data {folder}: the shards are from another tokenizer: the manifest names {spec['sha256']}, "
            f"{spec['file']} is {digest}"
        )
    return Corpus(folder, manifest, tokenizer, digest)


def open_nanogpt(folder, vocab_size):
    """nanoGPT's layout: train.bin and val.bin of uint16 ids, no manifest."""
    found = {}
    for name in prepare.SHARDS:
        path = folder / f"{name}.bin"
        if not path.is_file():
            raise DataError(f"--data {folder}: neither a {prepare.MANIFEST} nor {path.name} in it")
        size = path.stat().st_size
        found[name] = {"file": path.name, "tokens": size // 2, "bytes": size}
    tokenizer, digest = None, None
    if (folder / prepare.TOKENIZER).is_file():
        try:
            tokenizer, digest = tok.load(folder / prepare.TOKENIZER)
        except tok.TokenizerError as exc:
            raise DataError(f"--data {folder}: {exc}") from None
    elif (folder / "meta.pkl").is_file():
        tokenizer = read_meta(folder / "meta.pkl")
        digest = tok.digest(tokenizer.to_str())
    size = vocab_size or (tokenizer.vocab_size if tokenizer else GPT2_VOCAB)
    if size > 2**16:
        raise DataError(f"--data {folder}: nanoGPT's .bin files hold uint16 ids, below 65536: a "
                        f"vocabulary of {size} tokens does not fit them")  # fmt: skip
    manifest = {"tokenizer": {"vocab_size": size}, "dtype": "uint16", "shards": found}
    return Corpus(folder, manifest, tokenizer, digest)


class PlainUnpickler(pickle.Unpickler):
    """Reads plain containers, strings and numbers; refuses any pickle that names a class or a
    function, before anything is called: unpickling those is how a pickle runs code."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it names {module}.{name}, where only plain data may be")


def read_meta(path):
    """The character tokenizer of nanoGPT's meta.pkl
    (vocab_size, itos, stoi), read as plain data."""
    try:
        with open(path, "rb") as f:
            meta = PlainUnpickler(f).load()
        itos, size = meta["itos"], meta["vocab_size"]
        vocab = "".join(itos[i] for i in range(size))
        if len(vocab) != size or meta["stoi"] != {ch: i for i, ch in enumerate(vocab)}:
            raise ValueError("itos and stoi are not one character per id, both ways")
    except Exception as exc:  # a pickle that is not plain data, or not nanoGPT's layout
        raise DataError(f"--data {path.parent}: {path.name} cannot be used: {exc}") from None
    return tok.CharTokenizer(vocab)


GPT2_VOCAB = 50257  # tokens of GPT-2's BPE: the vocabulary when none is given


def load_corpus(source, cache_dir, timeout, kind="char", vocab_size=None):
    """The Corpus of --data: prepared shards as they are; text (`stdlib`, a file or
    folder, an http(s) URL) prepared with the tokenizer `kind` into the cache folder
    by the first process, once."""
    path = Path(source)
    if path.is_dir() and ((path / prepare.MANIFEST).exists() or (path / "train.bin").exists()):
        return open_shards(path, vocab_size)
    cache_dir = Path(cache_dir).expanduser()
    if re.match(r"https?://", source):
        path = cache_dir / f"url-{hashlib.sha256(source.encode()).hexdigest()[:16]}.txt"
        with file_lock(path.with_suffix(".lock"), timeout, f"the download of {source}"):
            if not path.exists():
                print(f"downloading {source} to {path} (other processes wait for it)", flush=True)
                download(source, path, timeout)
    elif "://" in source:
        raise DataError(f"--data {source}: only http:// and https:// addresses can be downloaded")
    elif source != "stdlib" and not path.exists():
        raise DataError(f"--data {source}: no such file")
    sources, vocab_size = ["stdlib" if source == "stdlib" else str(path)], vocab_size or GPT2_VOCAB
    try:
        key = prepare.fingerprint(sources, kind, vocab_size, "auto")
    except prepare.PrepareError as exc:
        raise DataError(f"--data {source}: {exc}") from None
    out = cache_dir / f"prepared-{key}"
    with file_lock(cache_dir / f"prepared-{key}.lock", timeout, f"the {kind} shards of {source} in {out}"):
        if not prepare.is_prepared(out, key):
            print(f"preparing the {kind} shards of {source} in {out} (other processes wait)", flush=True)
            try:
                prepare.prepare(sources, out, kind, vocab_size, log=lambda text: None)
            except prepare.PrepareError as exc:
                raise DataError(f"--data {source}: {exc}") from None
    return open_shards(out)


def step_offsets(seed, step, count, data_len, block_size):
    """Start offsets of one step's global batch, a function of (seed, step) alone: the order does
    not depend on the number of processes, and resuming at a step needs nothing but the step."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, data_len - block_size, (count,), generator=gen)


def gather(data, offsets, block_size, device=None):
    """Inputs and targets (shifted by one) for the given offsets, indexed where data lives
    (memory-mapped shards: only these windows are read), then on `device`."""
    idx = offsets.to(data.device, non_blocking=True)[:, None] + torch.arange(
        block_size + 1, device=data.device
    )
    chunk = data[idx].long()
    if device is not None and chunk.device != device:
        pinned = chunk.pin_memory() if device.type == "cuda" else chunk
        chunk = pinned.to(device, non_blocking=True)
    return chunk[:, :-1], chunk[:, 1:]


def default_cache_dir():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ddp-examples", "gpt")
