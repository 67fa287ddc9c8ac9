"""Text in; a tokenizer (one file) and train/val token shards out, for train.py --data OUT.

    python examples/gpt/prepare.py --out data/stdlib                 # the standard library, GPT-2-size BPE
    python examples/gpt/prepare.py my_texts/ notes.txt --out data/mine --vocab_size 8192
    python examples/gpt/prepare.py --out data/chars --tokenizer char

OUT then holds tokenizer.json, train.bin and val.bin (the ids, uint16 where the vocabulary fits,
else uint32; no header, as nanoGPT writes them) and manifest.json (the tokenizer's digest, the
token counts, the dtype, the shard sizes, a fingerprint of the input, and the data's digest: of the
tokenizer and every id, which the processes of a run compare before they train). Running it again
on the same input and options does nothing. Every file is written next to its final name and
renamed into place (checkpoint.atomic_write): a manifest that says the folder is incomplete first,
the complete manifest last. A run stopped before it writes leaves the previous output; stopped
later, a folder that train.py refuses in one line and prepare.py, run again, redoes; never a half
shard under a shard's name, nor shards without a manifest (which would read as nanoGPT's). Memory
does not grow with the text: it is read twice, a piece at a time (to train the tokenizer, then to
encode it in --workers processes, the cores by default), and the ids go to disk as they come.
"""

import argparse
import codecs
import collections
import hashlib
import json
import multiprocessing
import os
import re
import shutil
import signal
import sys
import sysconfig
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import tokenizer as tok
import torch
from snapshots.checkpoint import atomic_write, fsync_dir
from tqdm import tqdm

FORMAT = 1
VAL_FRACTION = 0.1  # the last tenth of the tokens is held out for validation
DTYPES = {"uint16": torch.uint16, "uint32": torch.uint32}
MANIFEST, TOKENIZER, SHARDS = "manifest.json", "tokenizer.json", ("train", "val")
INCOMPLETE = {"format": FORMAT, "incomplete": "prepare.py stopped before it finished this folder"}


class PrepareError(ValueError):
    """Input that cannot be prepared; the message (one line) names it."""


# folders of the standard library that are not its source: tests, and packages installed into it
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
NOT_PRINTABLE = re.compile(r"[^\x20-\x7e\n]")
PIECE = 1 << 20  # bytes of text read, and handed to a worker, at a time


def stdlib_key():
    """Names the standard library corpus of this Python without reading it."""
    version = f"{sys.implementation.name}-{sys.version_info.major}.{sys.version_info.minor}"
    return f"stdlib-{version}-{hashlib.sha256(sysconfig.get_paths()['stdlib'].encode()).hexdigest()[:8]}"


def stdlib_paths():
    """Every *.py file of the standard library outside test folders, in path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(root.rglob("*.py"))
    return [path for path in paths if not SKIP_DIRS & set(path.relative_to(root).parts[:-1])]


def text_files(source):
    """The files a source stands for: the file itself, or every file under a folder (sorted, hidden
    ones left out)."""
    if source == "stdlib":
        return stdlib_paths()
    path = Path(source)
    if path.is_file():
        return [path]
    if path.is_dir():
        found = sorted(
            p
            for p in path.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not found:
            raise PrepareError(f"{source}: the folder holds no files")
        return found
    raise PrepareError(f"{source}: no such file or folder")


def read_pieces(path, stdlib=False):
    """A file's text, read PIECE bytes at a time and cut at a line break between two non-spaces: a
    BPE's pre-tokenizer cuts there anyway, so the pieces encode as the whole file would. UTF-8 and
    the absence of NUL are checked as it goes; the standard library's files become printable ASCII,
    tabs four spaces."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace" if stdlib else "strict")
    read, rest = 0, ""
    try:
        f = open(path, "rb")
    except OSError as exc:
        if stdlib:
            return
        raise PrepareError(f"{path}: cannot read it: {exc.strerror}") from None
    with f:
        while True:
            raw = f.read(PIECE)
            pending = len(decoder.getstate()[0])
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as exc:
                at = read - pending + exc.start
                raise PrepareError(f"{path}: not UTF-8 text (byte {at} cannot be decoded)") from None
            read += len(raw)
            if stdlib:
                text = NOT_PRINTABLE.sub("", text.replace("\t", "    "))
            elif "\0" in text:
                raise PrepareError(f"{path}: not text (it holds NUL bytes)")
            text = rest + text
            if not raw:
                break
            cut = text.rfind("\n", 1, len(text) - 1)
            while cut >= 1 and (text[cut - 1].isspace() or text[cut + 1].isspace()):
                cut = text.rfind("\n", 1, cut)
            rest = text[cut + 1 :]
            if cut >= 1:
                yield text[: cut + 1]
    if text:
        yield text


def pieces(sources):
    """(text, last) for every piece of every document, last True on a document's final piece; empty
    documents left out."""
    for source in sources:
        for path in text_files(source):
            held = None
            for piece in read_pieces(path, stdlib=source == "stdlib"):
                if held is not None:
                    yield held, False
                held = piece
            if held:
                yield held, True


def corpus_bytes(sources):
    return sum(path.stat().st_size for source in sources for path in text_files(source))


def fingerprint(sources, kind, vocab_size, dtype):
    """What decides the output, found without reading the texts: the options, and
    each input file's path, size and modification time (the standard library's: its
    folder and the Python version)."""
    if kind not in tok.KINDS:  # a tokenizer file: what it holds
        kind = f"file {given_tokenizer(kind)[1]}"
    parts = [f"format {FORMAT}", kind, str(vocab_size), dtype]
    for source in sources:
        if source == "stdlib":
            parts.append(stdlib_key())
            continue
        for path in text_files(source):
            stat = path.stat()
            parts.append(f"{path.resolve()} {stat.st_size} {stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def given_tokenizer(path):
    """(tokenizer, digest) of a tokenizer file, or of the tokenizer.json in a folder (a Hugging
    Face model's): the ids are then that tokenizer's, to train a model that already reads them."""
    path = Path(path) / TOKENIZER if Path(path).is_dir() else Path(path)
    try:
        tokenizer, digest = tok.load(path)
    except tok.TokenizerError as exc:
        raise PrepareError(f"--tokenizer {path}: {exc}") from None
    if tokenizer.kind == "bpe" and tokenizer.hf.token_to_id(tok.EOT) is None:
        raise PrepareError(f"--tokenizer {path}: it has no {tok.EOT} token to end each document with")
    return tokenizer, digest


def shard_dtype(vocab_size, dtype):
    fits = "uint16" if vocab_size <= 2**16 else "uint32"
    if dtype == "auto":
        return fits
    if vocab_size > 2 ** (8 * DTYPES[dtype].itemsize):
        raise PrepareError(f"--dtype {dtype}: a vocabulary of {vocab_size} tokens does not fit; use {fits}")
    return dtype


def is_prepared(out, key):
    """out already holds the complete output of these inputs and options."""
    try:
        manifest = json.loads((Path(out) / MANIFEST).read_text())
        if "data_sha256" not in manifest:  # written before manifests held it: written again, to hold it
            return False
        return manifest.get("input") == key and all(
            (Path(out) / s["file"]).stat().st_size == s["bytes"] for s in manifest["shards"].values()
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def prepare(sources, out, kind="bpe", vocab_size=50257, dtype="auto", log=print, workers=None):
    """Tokenize sources into out (see the module's docstring); returns the manifest. Raises
    PrepareError, having written nothing, for input it cannot use. Memory stays flat: the text is
    read twice in pieces (to train the tokenizer, then to encode it in `workers` processes) and the
    ids go to disk as they come."""
    out = Path(out)
    if kind == "bpe" and vocab_size <= 256:
        raise PrepareError(f"--vocab_size {vocab_size}: a byte-level BPE needs more than 256 tokens")
    if dtype != "auto":  # the BPE's size is known before any work
        shard_dtype(vocab_size if kind == "bpe" else 1, dtype)
    key = fingerprint(sources, kind, vocab_size, dtype)
    if is_prepared(out, key):
        log(f"{out} is up to date: nothing to do")
        return json.loads((out / MANIFEST).read_text())
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--out {out}: exists and is not a folder")
    start, total = time.perf_counter(), corpus_bytes(sources)
    read = 0

    def texts():
        nonlocal read
        for text, _ in progress("reading", total, pieces(sources)):
            read += len(text)
            yield text

    tokenizer = make_tokenizer(kind, vocab_size, texts(), log)
    if read == 0:
        raise PrepareError(f"{' '.join(sources)}: no text in it")
    dtype = shard_dtype(tokenizer.vocab_size, dtype)
    spec = tokenizer.to_str()
    out.mkdir(parents=True, exist_ok=True)
    # The manifest first says the folder is being written, so that it is never read as nanoGPT's
    # shards (train.bin, no manifest) nor as prepared before the last file is in place; each file
    # is written beside its name and renamed over it (atomic_write), the complete manifest last.
    atomic_write(out / MANIFEST, lambda f: f.write(json.dumps(INCOMPLETE).encode()))
    atomic_write(out / TOKENIZER, lambda f: f.write(spec.encode()))
    sizes, counts, data_digest = write_shards(out, spec, tokenizer.vocab_size, sources, dtype, total, workers)
    manifest = describe(key, tokenizer, spec, dtype, sizes, counts, data_digest)
    atomic_write(out / MANIFEST, lambda f: f.write((json.dumps(manifest, indent=1) + "\n").encode()))
    fsync_dir(out)
    counts = ", ".join(f"{name} {s['tokens']}" for name, s in manifest["shards"].items())
    digest = manifest["tokenizer"]["sha256"]
    seconds = time.perf_counter() - start
    log(
        f"wrote {out}: {tokenizer.kind} tokenizer of {tokenizer.vocab_size} tokens ({digest}), "
        f"{dtype} shards of {counts} tokens in {seconds:.1f} s ({total / 1e6 / seconds:.1f} MB/s)"
    )
    return manifest


def describe(key, tokenizer, spec, dtype, sizes, counts, data_digest):
    """The manifest: what was read (key), the tokenizer,
    the shards, and a checksum of their ids."""
    return {
        "format": FORMAT,
        "input": key,
        "tokenizer": {
            "file": TOKENIZER,
            "sha256": tok.digest(spec),
            "kind": tokenizer.kind,
            "vocab_size": tokenizer.vocab_size,
        },
        "dtype": dtype,
        "shards": {
            name: {"file": f"{name}.bin", "tokens": size, "bytes": size * np.dtype(dtype).itemsize}
            for name, size in sizes.items()
        },
        "unigram_entropy": unigram_entropy(counts),
        "data_sha256": data_digest,
    }


def make_tokenizer(kind, vocab_size, texts, log):
    """The tokenizer to encode with: trained on texts (an iterable, read once), or a
    given file's (texts then read through all the same, so that bad input is refused
    before anything is written)."""
    if kind not in tok.KINDS:
        collections.deque(texts, maxlen=0)
        return given_tokenizer(kind)[0]
    tokenizer = tok.KINDS[kind].train(texts, vocab_size)
    if kind == "bpe" and tokenizer.vocab_size < vocab_size:
        log(f"the BPE has {tokenizer.vocab_size} tokens, not the {vocab_size} asked: the text holds no more "
            "pairs of tokens to merge; give more text for a larger vocabulary")  # fmt: skip
    return tokenizer


def write_shards(out, spec, vocab_size, sources, dtype, total, workers):
    """Encode the sources with the tokenizer `spec` into out's two shards, the ids going to disk as
    they come; returns ({shard: tokens}, each id's count in the training shard, the data's digest:
    of the tokenizer, the dtype, and each shard's name, size and ids)."""
    scratch = out / f"ids.tmp.{os.getpid()}"  # every id in order, split into the two shards at the end
    counts = np.zeros(vocab_size, dtype=np.int64)
    try:
        with open(scratch, "wb") as f:
            for ids in encode(spec, progress("encoding", total, pieces(sources)), workers):
                f.write(ids.astype(dtype).tobytes())
        tokens = scratch.stat().st_size // np.dtype(dtype).itemsize
        sizes = {"train": int(tokens * (1 - VAL_FRACTION))}
        sizes["val"] = tokens - sizes["train"]
        digest = hashlib.sha256(f"{tok.digest(spec)} {dtype}\n".encode())
        with open(scratch, "rb") as f:
            copy = {"train": counts, "val": None}
            for name, size in sizes.items():
                digest.update(f"{name} {size}\n".encode())
                atomic_write(
                    out / f"{name}.bin",
                    lambda dest, n=size, c=copy[name]: copy_ids(f, dest, n, dtype, c, digest),
                )
    finally:
        scratch.unlink(missing_ok=True)
    return sizes, counts, digest.hexdigest()


def copy_ids(src, dest, count, dtype, counts, digest):
    """count ids of dtype from the file src to dest, a block at a time, each block into the hash
    digest; counts (if given) adds up each id."""
    while count > 0:
        block = np.fromfile(src, dtype=dtype, count=min(count, PIECE))
        raw = block.tobytes()
        dest.write(raw)
        digest.update(raw)
        if counts is not None:
            counts += np.bincount(block, minlength=len(counts))
        count -= len(block)


def encode(spec, texts, workers=None):
    """The ids of each (text, last) piece, in order, as numpy arrays: encoded in `workers`
    processes (the cores by default), with at most two pieces a worker in flight."""
    workers = workers or len(os.sched_getaffinity(0))
    if workers == 1:  # here, in this process: its signal handlers and threads stay as they are
        WORKER["tokenizer"] = tok.from_str(spec, "the tokenizer being prepared")
        yield from map(encode_piece, texts)
        return
    # forked workers encode a piece each, without threads: tokenizers' own stay off (and silent
    # about the fork), torch's are one
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    fork = multiprocessing.get_context("fork")
    # an early end (the reader stopped, or failed) cancels the pieces not started and waits for the ones
    # being encoded: a worker is never killed (one killed while it wrote its result left the pool's
    # reader waiting for the rest forever), and a worker that dies fails the run instead of hanging it
    with ProcessPoolExecutor(workers, fork, initializer=start_worker, initargs=(spec,)) as pool:
        pending = collections.deque()
        try:
            for text in texts:
                pending.append(pool.submit(encode_piece, text))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


WORKER = {}  # a worker process's tokenizer


def start_worker(spec):
    # a SIGTERM sent to every process (Slurm's) ends a worker, where the parent's handler, copied in the
    # fork, would only note it (the trainer's preempt.StopRequest); Ctrl-C is the parent's to handle
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    WORKER["tokenizer"] = tok.from_str(spec, "the tokenizer being prepared")


def encode_piece(item):
    """One piece's ids; a document's last piece ends with the end-of-text token (BPE)."""
    text, last = item
    tokenizer = WORKER["tokenizer"]
    ids = tokenizer.encode(text).numpy()
    if last and tokenizer.kind == "bpe":
        ids = np.append(ids, tokenizer.start_id())  # the end-of-text token
    return ids


def progress(label, total, items):
    """items, (text, last) pieces, as they come; on a terminal (stderr) only, tqdm's bar of the
    total bytes gone through, with the throughput (in a pipe, nothing: disable=None). The
    terminal's size as shutil finds it, (80, 24) where the terminal says 0 by 0 (a new pty): tqdm
    would take that as no room to draw."""
    columns, lines = shutil.get_terminal_size()
    bar = tqdm(total=total, desc=label, unit="B", unit_scale=True, unit_divisor=1000, disable=None,
               ncols=columns - 1, nrows=lines - 1)  # fmt: skip
    with bar:
        for item in items:
            bar.update(len(item[0]))
            yield item


def unigram_entropy(counts):
    """Cross-entropy in nats of predicting every token
    from the tokens' frequencies (counts) alone."""
    p = counts[counts > 0] / max(counts.sum(), 1)
    return float(-(p * np.log(p)).sum())


def get_parser():
    p = argparse.ArgumentParser(description="Tokenize text into shards for examples/gpt/train.py --data.")
    p.add_argument(
        "sources", nargs="*", default=["stdlib"], metavar="SOURCE",
        help="UTF-8 text files or folders of them; stdlib: the Python standard library (the default)",
    )  # fmt: skip
    p.add_argument("--out", required=True, help="the folder to write (train.py --data OUT)")
    p.add_argument(
        "--tokenizer", default="bpe", metavar="{bpe,char,FILE}",
        help="train a byte-level BPE or take the characters (bpe); or encode with a tokenizer.json as it is "
        "(or a Hugging Face model's folder holding one)",
    )  # fmt: skip
    p.add_argument("--vocab_size", type=int, default=50257, help="BPE: tokens in all, GPT-2's by default")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="of the shards (auto: fits)")
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)), help="encoding processes")
    return p


def main():
    parser = get_parser()
    args = parser.parse_intermixed_args()  # sources before or after the options
    if args.workers < 1:
        parser.error(f"--workers must be positive, got {args.workers}")
    try:
        prepare(args.sources, args.out, args.tokenizer, args.vocab_size, args.dtype, workers=args.workers)
    except (PrepareError, tok.TokenizerError) as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    sys.exit(main())
