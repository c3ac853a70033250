"""Preprocessing throughput vs raw SentencePiece, and sample-index build time, in one run.

    python benchmarks/preprocess.py [--mb 100] [--repeats 3] [--index-tokens 1e9] [--write benchmarks/README.md]

On the same text (the embedded People's Daily corpus as ``{"text": ...}`` jsonl,
repeated to ``--mb`` MB of UTF-8 text) and the same tokenizer
(``tokenizers/pd1998-bpe16k``), side by side:

  * raw SentencePiece: ``sp.encode(batch, num_threads=1)`` over texts already in
    memory, ~1 MB batches: the per-core limit (and ``num_threads=2`` for reference);
  * ``llmtrain.data.preprocess`` with 1 and 2 worker processes: reading, JSON
    parsing, validation, encoding, writing ``.bin``/``.idx``, pool start-up included;
  * a naive single-process loop: ``json.loads`` + ``sp.encode`` + write per line.

Each variant runs ``--repeats`` times, interleaved; the best run is reported
(the machine is shared, the best run is the least disturbed one). MB/s counts
UTF-8 text bytes. "per worker" divides by the processes (or threads) that encode;
the ratio compares that with the raw single-thread limit.

Then the packing index (``llmtrain.data.packing``) of a synthetic corpus of
``--index-tokens`` tokens (log-normal document lengths, mean ~512): the numpy
build alone, and the full cached build (fingerprint, build, ``.npy`` writes).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llmtrain.corpus.parse import ParseOptions, parse_chunk  # noqa: E402
from llmtrain.corpus.peoples_daily import records  # noqa: E402
from llmtrain.corpus.sources import expand_inputs, iter_chunks  # noqa: E402
from llmtrain.data.encoding import encode_chunk, init_worker  # noqa: E402
from llmtrain.data.indexed import IndexedDataset, write_index  # noqa: E402
from llmtrain.data.packing import PackedSplit, build_epoch  # noqa: E402
from llmtrain.data.preprocess import preprocess  # noqa: E402
from llmtrain.tokenizer import load_tokenizer  # noqa: E402

TOKENIZER = REPO / "tokenizers" / "pd1998-bpe16k"


def make_corpus(path: Path, mb: float) -> tuple[list[str], int]:
    base = [r["text"] for r in records()]
    texts, nbytes = [], 0
    while nbytes < mb * 1e6:
        for t in base:
            texts.append(t)
            nbytes += len(t.encode("utf-8"))
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
    return texts, nbytes


def batches(texts: list[str], batch_bytes: int = 1 << 20) -> list[list[str]]:
    out, cur, n = [], [], 0
    for t in texts:
        cur.append(t)
        n += len(t) * 3
        if n >= batch_bytes:
            out.append(cur)
            cur, n = [], 0
    return out + ([cur] if cur else [])


def cpu_of(fn):
    """Run ``fn`` -> (tokens, encoding CPU s, main-process CPU s) for in-process variants."""
    c0 = time.process_time()
    n = fn()
    c = time.process_time() - c0
    return n, c, c


def raw_sentencepiece(tok, text_batches, threads: int) -> int:
    """Tokens including one EOD per document (counted, not written), like the other variants."""
    return sum(len(x) + 1 for b in text_batches for x in tok.sp.encode(b, num_threads=threads))


def naive_loop(tok, path: Path, prefix: str) -> int:
    sizes, n = [], 0
    with open(path, encoding="utf-8") as f, open(prefix + ".bin", "wb") as out:
        for line in f:
            ids = tok.encode(json.loads(line)["text"]) + [tok.eod_id]
            out.write(np.array(ids, dtype=np.uint16).tobytes())
            sizes.append(len(ids))
            n += len(ids)
    write_index(prefix + ".idx", np.uint16, np.array(sizes), np.arange(len(sizes) + 1))
    return n


def ours(path: Path, prefix: str, workers: int):
    r = preprocess([str(path)], str(TOKENIZER), prefix, workers=workers, progress=False)
    return r.tokens, r.worker_cpu_seconds, r.main_cpu_seconds


def bench_preprocess(mb: float, repeats: int, tmp: Path) -> tuple[list[dict], dict]:
    tok = load_tokenizer(TOKENIZER)
    corpus = tmp / "corpus.jsonl"
    texts, nbytes = make_corpus(corpus, mb)
    tb = batches(texts)
    variants = {
        "raw SentencePiece, 1 thread (the limit)": (1, lambda: cpu_of(lambda: raw_sentencepiece(tok, tb, 1))),
        "raw SentencePiece, 2 threads": (2, lambda: cpu_of(lambda: raw_sentencepiece(tok, tb, 2))),
        "llmtrain.data.preprocess, 1 worker": (1, lambda: ours(corpus, str(tmp / "w1"), 1)),
        "llmtrain.data.preprocess, 2 workers": (2, lambda: ours(corpus, str(tmp / "w2"), 2)),
        "naive loop (json.loads + encode + write per line)":
            (1, lambda: cpu_of(lambda: naive_loop(tok, corpus, str(tmp / "nv")))),
    }
    one_doc = tmp / "one.jsonl"  # fixed cost of a run: pool start-up, tokenizer load, file set-up
    one_doc.write_text(json.dumps({"text": texts[0]}, ensure_ascii=False) + "\n", encoding="utf-8")
    times = {k: [] for k in variants}
    cpu = {k: [] for k in variants}  # (encoding CPU s, main-process CPU s) per run
    startup = {1: [], 2: []}
    tokens = {}
    for _ in range(repeats):  # interleaved, so a disturbance hits every variant alike
        for name, (_, fn) in variants.items():
            t0 = time.perf_counter()
            tokens[name], c_enc, c_main = fn()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append((c_enc, c_main))
        for w in startup:
            t0 = time.perf_counter()
            ours(one_doc, str(tmp / "one"), w)
            startup[w].append(time.perf_counter() - t0)
    assert len({v for k, v in tokens.items()}) == 1, f"variants disagree on the token count: {tokens}"
    assert (tmp / "w1.bin").read_bytes() == (tmp / "w2.bin").read_bytes() == (tmp / "nv.bin").read_bytes()
    limit = nbytes / min(times["raw SentencePiece, 1 thread (the limit)"]) / 1e6
    cpu_limit = min(c for c, _ in cpu["raw SentencePiece, 1 thread (the limit)"])  # CPU s of raw encoding
    rows = []
    for name, (procs, _) in variants.items():
        best = min(times[name])
        mbs = nbytes / best / 1e6
        rows.append({"variant": name, "procs": procs, "seconds": round(best, 3),
                     "median_seconds": round(statistics.median(times[name]), 3), "MB/s": round(mbs, 2),
                     "tokens/s": round(tokens[name] / best), "MB/s per worker": round(mbs / procs, 2),
                     "tokens/s per worker": round(tokens[name] / best / procs),
                     "ratio to limit": round(mbs / procs / limit, 3),
                     "encoding CPU s": round(min(c for c, _ in cpu[name]), 2),
                     "main-process CPU s": round(min(m for _, m in cpu[name]), 2),
                     "CPU ratio to limit": round(cpu_limit / min(c for c, _ in cpu[name]), 3)})
    info = {"text_MB": round(nbytes / 1e6, 1), "documents": len(texts), "tokens": tokens[name],
            "repeats": repeats, "startup_s": {w: round(min(v), 3) for w, v in startup.items()}}
    for r in rows:  # the same ratio with the fixed start-up cost taken out (what a large corpus sees)
        w = 1 if r["variant"].endswith("1 worker") else 2 if r["variant"].endswith("2 workers") else None
        steady = min(times[r["variant"]]) - (min(startup[w]) if w else 0.0)
        r["ratio without start-up"] = round(nbytes / steady / 1e6 / r["procs"] / limit, 3)
    return rows, info


def breakdown(corpus: Path, repeats: int) -> dict:
    """CPU seconds of the worker's steps on the whole corpus, in this process.

    Per chunk, interleaved so that a disturbance hits all alike: parse alone, SentencePiece on the
    parsed texts, then the whole worker function; the pass with the least total CPU is kept.
    """
    init_worker(str(TOKENIZER), ParseOptions(), None)
    tok = load_tokenizer(TOKENIZER)
    chunks = list(iter_chunks(expand_inputs([str(corpus)])[0][0], ParseOptions()))
    best = None
    for _ in range(repeats):
        parse = encode = full = 0.0
        for c in chunks:
            t0 = time.process_time()
            texts = parse_chunk(c, ParseOptions()).texts
            t1 = time.process_time()
            tok.sp.encode(texts, num_threads=1)
            t2 = time.process_time()
            encode_chunk(c)
            t3 = time.process_time()
            parse, encode, full = parse + t1 - t0, encode + t2 - t1, full + t3 - t2
        if best is None or full < best[2]:
            best = (parse, encode, full)
    parse, encode, full = best
    return {"parse": round(parse, 2), "encode": round(encode, 2), "rest": round(max(full - parse - encode, 0), 2),
            "full": round(full, 2), "ratio": round(encode / full, 3)}


def bench_index(n_tokens: float, tmp: Path, seq_lens=(1024, 128)) -> list[dict]:
    rng = np.random.default_rng(0)
    n_docs = int(n_tokens / 512 * 1.05) + 1
    sizes = np.maximum(1, rng.lognormal(mean=np.log(512) - 0.5, sigma=1.0, size=n_docs)).astype(np.int32)
    keep = np.searchsorted(np.cumsum(sizes, dtype=np.int64), int(n_tokens))
    sizes = sizes[: keep + 1]
    total = int(sizes.sum(dtype=np.int64))
    prefix = str(tmp / "synthetic")
    write_index(prefix + ".idx", np.uint16, sizes, np.arange(len(sizes) + 1))
    with open(prefix + ".bin", "wb") as f:  # sparse: the index build never reads tokens
        f.truncate(total * 2)
    ds = IndexedDataset(prefix)
    rows = []
    for L in seq_lens:
        t0 = time.perf_counter()
        _, sample_idx, _ = build_epoch(ds.sizes, (0, len(sizes)), L, 1234, 0)
        t_numpy = time.perf_counter() - t0
        ps = PackedSplit(ds, "train", (0, len(sizes)), L, 1234, cache_dir=str(tmp / "cache"))
        t0 = time.perf_counter()
        ps.build(0)
        t_cached = time.perf_counter() - t0
        t0 = time.perf_counter()
        PackedSplit(ds, "train", (0, len(sizes)), L, 1234, cache_dir=str(tmp / "cache")).epoch_index(0)
        t_load = time.perf_counter() - t0
        rows.append({"tokens": total, "documents": len(sizes), "seq_len": L, "samples": len(sample_idx) - 1,
                     "numpy build s": round(t_numpy, 2), "cached build s": round(t_cached, 2),
                     "load s": round(t_load, 3)})
    return rows


def machine() -> str:
    cpu = platform.processor() or ""
    try:
        cpu = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text()).group(1)
    except (OSError, AttributeError):
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{cpu}, {os.cpu_count()} cores, load average {load:.2f} at start, {time.strftime('%Y-%m-%d')}"


def table(rows: list[dict], cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(f"{r[c]:,}" if isinstance(r[c], int) and c != "seq_len" else str(r[c])
                                for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def section(pre, info, idx, host, argv) -> str:
    by = {r["variant"]: r for r in pre}
    two = by["llmtrain.data.preprocess, 2 workers"]["MB/s"] / by["raw SentencePiece, 2 threads"]["MB/s"]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"""## Preprocessing

Measured by `python benchmarks/preprocess.py {' '.join(argv)}` on {host}; load average {load:.2f} at the end.
Same text for every row: the embedded People's Daily corpus as `{{"text": ...}}` jsonl repeated to
{info['text_MB']} MB of UTF-8 text ({info['documents']:,} documents, {info['tokens']:,} tokens with
`tokenizers/pd1998-bpe16k`); best of {info['repeats']} interleaved runs. Every variant writes the same
tokens (checked). "ratio to limit" = MB/s per worker / raw single-thread SentencePiece MB/s
(goal for our preprocessor: >= 0.8).

{table(pre, ["variant", "MB/s", "tokens/s", "MB/s per worker", "tokens/s per worker", "ratio to limit",
            "ratio without start-up", "seconds", "median_seconds"])}

The same runs by CPU time, which other jobs on the machine distort less than wall time: "encoding CPU s" is the CPU
time of the processes (or threads) that parse and encode (for ours: the workers, start-up included),
"main-process CPU s" that of our reading/writing process, and "CPU ratio to limit" = raw single-thread
SentencePiece CPU s / encoding CPU s for the same text (1.0 = no overhead per worker).

{table(pre, ["variant", "encoding CPU s", "main-process CPU s", "CPU ratio to limit"])}

Where a worker's CPU goes, measured in one process on the same text (`encode_chunk` on every chunk, best of
{info['repeats']}): decoding + JSON parsing + validation {info['breakdown']['parse']} s, SentencePiece encoding
{info['breakdown']['encode']} s, the rest (ids to one numpy array with EODs) {info['breakdown']['rest']} s; encoding
is {info['breakdown']['ratio']} of the worker function's CPU. The naive loop pays the same parsing and conversion,
which is why it lands near our single worker; our preprocessor adds processes, bounded streaming, bad-record
accounting and normalisation on top, at about the per-worker cost shown above.

Start-up of a `preprocess` run (forkserver pool, worker imports, tokenizer load), measured on a one-document
input: {info['startup_s'][1]} s with 1 worker, {info['startup_s'][2]} s with 2; "ratio without start-up"
subtracts it, which is what a corpus of many GB sees. With 2 processes on 2 cores our main process (reading,
writing) competes with the workers; in this run 2 workers reach {two:.2f} of raw SentencePiece's 2-thread
throughput. The machine is shared with other jobs (see the load averages): compare rows of one run, not runs.

Sample index (`llmtrain.data.packing`, document/sample/shuffle indices of one epoch) of a synthetic
corpus (log-normal document lengths): numpy build alone, the cached build (`.idx` fingerprint, build,
`.npy` writes) and loading the cached files (memory-mapped). Goal: under 60 s for 1e9 tokens.

{table(idx, ["tokens", "documents", "seq_len", "samples", "numpy build s", "cached build s", "load s"])}
"""


def write_section(readme: Path, text: str) -> None:
    old = readme.read_text() if readme.is_file() else "# Benchmarks\n\n"
    m = re.search(r"^## Preprocessing\n.*?(?=^## |\Z)", old, flags=re.S | re.M)
    new = old[: m.start()] + text + ("\n" if old[m.end():] else "") + old[m.end():] if m else \
        old.rstrip("\n") + "\n\n" + text
    readme.write_text(new)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=100.0, help="MB of text to encode")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--index-tokens", type=float, default=1e9)
    p.add_argument("--write", default=None, help="replace the '## Preprocessing' section of this README")
    p.add_argument("--tmp", default=None, help="scratch folder (default: a temporary one)")
    a = p.parse_args(argv)
    host = machine()
    with tempfile.TemporaryDirectory(dir=a.tmp) as tmp:
        pre, info = bench_preprocess(a.mb, a.repeats, Path(tmp))
        info["breakdown"] = breakdown(Path(tmp) / "corpus.jsonl", a.repeats)
        idx = bench_index(a.index_tokens, Path(tmp))
    text = section(pre, info, idx, host, [x for x in argv if not x.startswith("--write")
                                          and x != a.write])
    print(text)
    print(json.dumps({"preprocess": pre, "index": idx, "info": info}, indent=1), file=sys.stderr)
    if a.write:
        write_section(Path(a.write), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
