"""Text in; a tokenizer (one file) and train/val token shards out, for train.py --data OUT.

    python examples/gpt/prepare.py --out data/stdlib                 # the standard library, GPT-2-size BPE
    python examples/gpt/prepare.py my_texts/ notes.txt --out data/mine --vocab_size 8192
    python examples/gpt/prepare.py --out data/chars --tokenizer char

OUT then holds tokenizer.json, train.bin and val.bin (the ids, uint16 where the vocabulary fits, else uint32;
no header, as nanoGPT writes them) and manifest.json (the tokenizer's digest, the token counts, the dtype, the
shard sizes, and a fingerprint of the input). Running it again on the same input and options does nothing.
Every file is written next to its final name and renamed into place (checkpoint.atomic_write): a manifest that
says the folder is incomplete first, the complete manifest last. A run stopped before it writes leaves the
previous output; stopped later, a folder that train.py refuses in one line and prepare.py, run again, redoes;
never a half shard under a shard's name, nor shards without a manifest (which would read as nanoGPT's).
"""

import argparse
import hashlib
import json
import re
import sys
import sysconfig
import time
from pathlib import Path

import tokenizer as tok
import torch
from checkpoint import atomic_write, fsync_dir

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


def stdlib_key():
    """Names the standard library corpus of this Python without reading it."""
    version = f"{sys.implementation.name}-{sys.version_info.major}.{sys.version_info.minor}"
    return f"stdlib-{version}-{hashlib.sha256(sysconfig.get_paths()['stdlib'].encode()).hexdigest()[:8]}"


def stdlib_files():
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
    return parts


def text_files(source):
    """The files a source stands for: the file itself, or every file under a folder (sorted, hidden ones
    left out)."""
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


def read_text(path):
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise PrepareError(f"{path}: cannot read it: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PrepareError(f"{path}: not UTF-8 text (byte {exc.start} cannot be decoded)") from None
    if "\0" in text:
        raise PrepareError(f"{path}: not text (it holds NUL bytes)")
    return text


def fingerprint(sources, kind, vocab_size, dtype):
    """What decides the output, found without reading the texts: the options, and each input file's path,
    size and modification time (the standard library's: its folder and the Python version)."""
    parts = [f"format {FORMAT}", kind, str(vocab_size), dtype]
    for source in sources:
        if source == "stdlib":
            parts.append(stdlib_key())
            continue
        for path in text_files(source):
            stat = path.stat()
            parts.append(f"{path.resolve()} {stat.st_size} {stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def read_documents(sources):
    docs = []
    for source in sources:
        if source == "stdlib":
            docs += stdlib_files()
        else:
            docs += [read_text(path) for path in text_files(source)]
    docs = [doc for doc in docs if doc]
    if not docs:
        raise PrepareError(f"{' '.join(sources)}: no text in it")
    return docs


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
        return manifest.get("input") == key and all(
            (Path(out) / s["file"]).stat().st_size == s["bytes"] for s in manifest["shards"].values()
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def prepare(sources, out, kind="bpe", vocab_size=50257, dtype="auto", log=print):
    """Tokenize sources into out (see the module's docstring); returns the manifest. Raises PrepareError,
    having written nothing, for input it cannot use."""
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
    start = time.perf_counter()
    docs = read_documents(sources)
    tokenizer = tok.KINDS[kind].train(docs, vocab_size)
    ids = tokenizer.encode_documents(docs) if kind == "bpe" else tokenizer.encode("".join(docs))
    dtype = shard_dtype(tokenizer.vocab_size, dtype)
    cut = int(len(ids) * (1 - VAL_FRACTION))
    parts = {"train": ids[:cut], "val": ids[cut:]}
    spec = tokenizer.to_str()
    manifest = {
        "format": FORMAT,
        "input": key,
        "tokenizer": {
            "file": TOKENIZER,
            "sha256": tok.digest(spec),
            "kind": kind,
            "vocab_size": tokenizer.vocab_size,
        },
        "dtype": dtype,
        "shards": {
            name: {"file": f"{name}.bin", "tokens": len(part), "bytes": len(part) * DTYPES[dtype].itemsize}
            for name, part in parts.items()
        },
        "unigram_entropy": unigram_entropy(parts["train"], tokenizer.vocab_size),
    }
    out.mkdir(parents=True, exist_ok=True)
    # The manifest first says the folder is being written, so that it is never read as nanoGPT's shards
    # (train.bin, no manifest) nor as prepared before the last file is in place; each file is written
    # beside its name and renamed over it (atomic_write), the complete manifest last.
    atomic_write(out / MANIFEST, lambda f: f.write(json.dumps(INCOMPLETE).encode()))
    atomic_write(out / TOKENIZER, lambda f: f.write(spec.encode()))
    for name, part in parts.items():
        atomic_write(
            out / f"{name}.bin", lambda f, part=part: f.write(part.to(DTYPES[dtype]).numpy().tobytes())
        )
    atomic_write(out / MANIFEST, lambda f: f.write((json.dumps(manifest, indent=1) + "\n").encode()))
    fsync_dir(out)
    counts = ", ".join(f"{name} {s['tokens']}" for name, s in manifest["shards"].items())
    digest = manifest["tokenizer"]["sha256"]
    log(
        f"wrote {out}: {kind} tokenizer of {tokenizer.vocab_size} tokens ({digest}), "
        f"{dtype} shards of {counts} tokens in {time.perf_counter() - start:.1f} s"
    )
    return manifest


def unigram_entropy(ids, vocab_size):
    """Cross-entropy in nats of predicting every token from the tokens' frequencies alone."""
    counts = torch.bincount(ids.long(), minlength=vocab_size).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def get_parser():
    p = argparse.ArgumentParser(description="Tokenize text into shards for examples/gpt/train.py --data.")
    p.add_argument(
        "sources", nargs="*", default=["stdlib"], metavar="SOURCE",
        help="UTF-8 text files or folders of them; stdlib: the Python standard library (the default)",
    )  # fmt: skip
    p.add_argument("--out", required=True, help="the folder to write (train.py --data OUT)")
    p.add_argument("--tokenizer", choices=tok.KINDS, default="bpe", help="byte-level BPE or characters (bpe)")
    p.add_argument("--vocab_size", type=int, default=50257, help="BPE: tokens in all, GPT-2's by default")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="of the shards (auto: fits)")
    return p


def main():
    parser = get_parser()
    args = parser.parse_intermixed_args()  # sources before or after the options
    try:
        prepare(args.sources, args.out, args.tokenizer, args.vocab_size, args.dtype)
    except (PrepareError, tok.TokenizerError) as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    sys.exit(main())
