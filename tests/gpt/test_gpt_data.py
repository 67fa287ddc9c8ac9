"""Data sources of the GPT trainer, besides prepare.py's folders (test_gpt_prepare.py): nanoGPT's .bin files
and char folders read as they are, memory-mapped shards whose size leaves every process's memory unchanged,
a local text file, a URL downloaded once and cached, and bad data refused. Runs use the tiny model."""

import http.server
import json
import os
import pickle
import re
import socket
import threading
import time

import numpy as np
import pytest
from gpt_helpers import RunsCode, train
from helpers import (
    REPO,
    free_port,
    import_gpt_module,
)
from test_gpt_prepare import SHORT, files_in


# ---- nanoGPT's files -------------------------------------------------------------------------------------
def test_nanogpt_bin_files_are_read_as_they_are(tmp_path, cache):
    """nanoGPT's prepare.py writes np.array(ids, dtype=np.uint16).tofile('train.bin'): no header."""
    folder = tmp_path / "nanogpt"
    folder.mkdir()
    gen = np.random.default_rng(0)
    ids = {name: gen.integers(0, 65, size, dtype=np.uint16) for name, size in (("train", 5000), ("val", 600))}
    for name, values in ids.items():
        np.array(values, dtype=np.uint16).tofile(folder / f"{name}.bin")
    data = import_gpt_module("data")
    corpus = data.open_shards(folder, 65)
    assert corpus.train.long().tolist() == ids["train"].tolist()
    assert corpus.val.long().tolist() == ids["val"].tolist()
    with pytest.raises(data.DataError, match=r"nanoGPT's \.bin files hold uint16 ids, below 65536"):
        data.open_shards(folder, 65537)
    proc = train(tmp_path, cache, "--data", folder, "--vocab_size", 65, *SHORT)
    assert "vocabulary 65, no tokenizer, 5000 training tokens" in proc.stdout, proc.stdout[-2000:]
    assert files_in(folder) == ["train.bin", "val.bin"]  # nothing written beside them


def nanogpt_char_folder(folder, text):
    """A folder as nanoGPT's shakespeare_char/prepare.py writes it: uint16 ids of the sorted characters, and
    meta.pkl with vocab_size, itos and stoi."""
    folder.mkdir()
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    ids = np.array([stoi[ch] for ch in text], dtype=np.uint16)
    cut = int(len(ids) * 0.9)
    ids[:cut].tofile(folder / "train.bin")
    ids[cut:].tofile(folder / "val.bin")
    meta = {"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}
    (folder / "meta.pkl").write_bytes(pickle.dumps(meta))
    return len(chars)


def test_nanogpt_char_folders_train_and_a_code_running_meta_is_refused(tmp_path, cache):
    """nanoGPT char folders train their own vocabulary and a meta.pkl that runs code is refused.

    nanoGPT's shakespeare_char layout, given with --data alone, trains a model of meta.pkl's vocabulary
    (its first validation loss near ln(vocabulary), not GPT-2's ln 50257 = 10.8) and decodes its samples
    through itos. meta.pkl is read by an unpickler that admits plain data only: one that would call
    os.system is refused in one line, exit 2, and nothing runs. Mutation: pickle.load in its place: the
    command runs (the file `pwned` appears) and training goes on."""
    folder = tmp_path / "shakespeare_char"
    vocab = nanogpt_char_folder(folder, (REPO / "README.md").read_text())
    proc = train(tmp_path, cache, "--data", folder, *SHORT[:-2], "--sample_chars", 200)
    assert f"vocabulary {vocab}, char tokenizer" in proc.stdout, proc.stdout[-2000:]
    first = float(re.search(r"^step \d+ \| val loss ([0-9.]+)$", proc.stdout, re.M).group(1))
    assert abs(first - np.log(vocab)) < 1, (first, vocab)
    sample = proc.stdout.split("sample:\n", 1)[1]
    assert re.search(r"[a-z]{2}", sample) and not re.fullmatch(r"[\d\s]+", sample), sample
    (folder / "meta.pkl").write_bytes(pickle.dumps(RunsCode()))
    proc = train(tmp_path, cache, "--data", folder, *SHORT, "--snapshot_path", "other", check=False)
    message = f"train.py: error: --data {folder}: meta.pkl cannot be used: it names posix.system"
    assert proc.returncode == 2 and proc.stdout.strip().splitlines()[-1].startswith(message), proc.stdout
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "other").exists()


# ---- memory-mapped shards --------------------------------------------------------------------------------
def random_shards(folder, tokens):
    """nanoGPT-style shards of random ids below 256, on disk and out of the page cache, as a corpus larger
    than memory is (a file just written is cached in large pages, each mapped whole by the first read)."""
    folder.mkdir()
    gen = np.random.default_rng(1)
    for name, size in (("train", tokens), ("val", tokens // 10)):
        path = folder / f"{name}.bin"
        gen.integers(0, 256, size, dtype=np.uint16).tofile(path)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return folder


def peak_rss(metrics):
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["rank"]: r["memory"]["peak_bytes"] for r in records if "memory" in r}


def test_a_20x_larger_corpus_leaves_peak_memory_unchanged(tmp_path, cache):
    """A corpus 20 times larger leaves every process's peak memory unchanged.

    Each of 2 DDP processes maps the shards and reads its own windows: with 20M tokens (40 MB;
    160 MB as the trainer's int64) instead of 1M, no process's peak RSS (VmHWM) grows by more than 2% (690.9
    and 690.9 MiB). Mutation: a page of every 4 kB of the training shard read at start-up: 692 -> 727 MiB."""
    peaks = {}
    for name, tokens in (("small", 1_000_000), ("large", 20_000_000)):
        folder = random_shards(tmp_path / name, tokens)
        metrics = tmp_path / f"{name}.jsonl"
        args = ["--data", folder, "--vocab_size", 256, "--metrics_path", metrics, "--snapshot_path", name]
        train(tmp_path, cache, *args, *SHORT, "--eval_samples", 8, nproc=2)
        peaks[name] = peak_rss(metrics)
    print(
        {
            name: {rank: f"{peak / 2**20:.1f} MiB" for rank, peak in ranks.items()}
            for name, ranks in peaks.items()
        }
    )
    assert sorted(peaks["small"]) == [0, 1]
    for rank, small in peaks["small"].items():
        large = peaks["large"][rank]
        assert large <= small * 1.02, f"rank {rank}: peak RSS {small / 2**20:.0f} -> {large / 2**20:.0f} MiB"


# ---- data sources and bad input ----------------------------------------------------------------------
@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text((REPO / "benchmarks" / "lessons.py").read_text() * 2)
    return path


def test_a_local_text_file_is_a_corpus(tmp_path, cache, text_file):
    proc = train(tmp_path, cache, "--data", text_file, "--max_steps", 5, "--batch_size", 4)
    vocab = len(set(text_file.read_text()))
    assert f"vocabulary {vocab}," in proc.stdout, proc.stdout[-2000:]


@pytest.fixture
def http_server(text_file):
    requests = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(text_file.parent), **kwargs)

        def log_message(self, *args):
            requests.append(self.path)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/{text_file.name}", requests, server
    server.shutdown()
    server.server_close()


def test_an_http_url_is_downloaded_once_and_cached(tmp_path, text_file, http_server):
    url, requests, server = http_server
    cache = tmp_path / "cache"
    args = ["--data", url, "--max_steps", 3, "--batch_size", 4, "--sample_chars", 0]
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        train(tmp_path / name, cache, *args)
        server.shutdown()  # the second run must work from the cache alone
    assert len(requests) == 1, requests
    cached = [p for p in cache.iterdir() if p.suffix == ".txt"]
    assert len(cached) == 1 and cached[0].read_bytes() == text_file.read_bytes()


def test_an_unreachable_url_fails_within_the_timeout_and_writes_nothing(tmp_path):
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/corpus.txt"
        (tmp_path / "run").mkdir()
        start = time.monotonic()
        proc = train(tmp_path / "run", tmp_path / "cache", "--data", url, "--timeout", 2, check=False)
        seconds = time.monotonic() - start
    assert proc.returncode == 2, proc.stdout[-2000:]
    assert f"--data {url}: cannot download it within 2 s" in proc.stdout, proc.stdout[-2000:]
    assert seconds < 60
    assert not list((tmp_path / "run").iterdir())
    # in the cache, only the lock and the failure it leaves for processes that waited on it
    assert not [p for p in (tmp_path / "cache").iterdir() if p.suffix not in (".lock", ".failed")]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("missing.txt", "--data missing.txt: no such file"),
        ("short.txt", "is shorter than one sample of block_size + 1 = 65"),
        ("http://127.0.0.1:PORT/x.txt", "cannot download it within"),  # a free port: nothing listens
    ],
)
def test_bad_data_exits_2_and_writes_nothing(tmp_path, data, message):
    data = data.replace("PORT", str(free_port()))  # here, not in the test's name: the same in every worker
    (tmp_path / "short.txt").write_text("x = 1\n" * 20)
    proc = train(tmp_path, tmp_path / "cache", "--data", data, "--metrics_path", "m", check=False)
    assert proc.returncode == 2, proc.stdout[-2000:]
    assert message in proc.stdout and "Traceback" not in proc.stdout, proc.stdout[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == ["short.txt"]
