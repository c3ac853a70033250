"""Preprocessing throughput vs raw SentencePiece, and sample-index build time, in one run.

    python benchmarks/preprocess.py [--mb 75] [--repeats 5] [--index-tokens 1e9] [--write benchmarks/README.md]

On the same text (the embedded People's Daily corpus as ``{"text": ...}`` jsonl,
repeated to ``--mb`` MB of UTF-8 text) and the same tokenizer
(``tokenizers/pd1998-bpe16k``), side by side:

  * raw SentencePiece over texts already in memory, ~1 MB batches, one thread:
    ``sp.encode(batch, out_type="numpy", add_eos=True, num_threads=1)`` (the call our
    workers make: the limit) and ``sp.encode(batch, num_threads=1)`` (ids as Python
    lists, the limit used before); ``num_threads=2`` for reference;
  * ``llmtrain.data.preprocess`` with 1 and 2 worker processes: reading, JSON
    parsing, validation, encoding, writing ``.bin``/``.idx``, pool start-up included;
  * a naive single-process loop: ``json.loads`` + ``sp.encode`` + write per line.

Both sides are timed the same way: wall clock (``perf_counter``) and CPU time around one
call that turns the whole text into ids; raw SentencePiece gets fresh ``str`` objects each
run, made before its clock starts (CPython keeps the UTF-8 form of a string once
SentencePiece has asked for it, which a preprocessor never gets for free). Every variant
first runs once untimed (warm-up), then ``--repeats`` rounds, interleaved so that a
disturbance hits every variant alike; medians are reported. MB/s counts UTF-8 text bytes.
"per worker" divides by the processes (or threads) that encode; the ratio compares that
with the raw single-thread limit.

Then the packing index (``llmtrain.data.packing``) of a synthetic corpus of
``--index-tokens`` tokens (log-normal document lengths, mean ~512): the numpy
build alone, and the full cached build (fingerprint, build, ``.npy`` writes).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import platform
import pstats
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
LIMIT = "raw SentencePiece, 1 thread, numpy ids (the limit)"
LISTS = "raw SentencePiece, 1 thread, ids as lists"
OURS1, OURS2 = "llmtrain.data.preprocess, 1 worker", "llmtrain.data.preprocess, 2 workers"


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


def fresh(text_batches: list[list[str]]) -> list[list[str]]:
    """Equal strings that SentencePiece has never seen (no cached UTF-8 form)."""
    return [[t.encode("utf-8").decode("utf-8") for t in b] for b in text_batches]


def raw_sentencepiece(tok, text_batches, threads: int, numpy_ids: bool) -> int:
    """Tokens including one EOD per document (counted, not written), like the other variants."""
    if numpy_ids:
        return sum(len(x) for b in text_batches
                   for x in tok.sp.encode(b, out_type="numpy", add_eos=True, num_threads=threads))
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


def bench_preprocess(mb: float, repeats: int, tmp: Path) -> tuple[list[dict], dict]:
    tok = load_tokenizer(TOKENIZER)
    corpus = tmp / "corpus.jsonl"
    texts, nbytes = make_corpus(corpus, mb)
    tb = batches(texts)

    def in_process(fn):  # -> prepare, run; run returns (tokens, encoding CPU s, main-process CPU s)
        def run(arg):
            c0 = time.process_time()
            n = fn(arg)
            c = time.process_time() - c0
            return n, c, c
        return run

    def ours(workers: int, prefix: str):
        def run(_):
            r = preprocess([str(corpus)], str(TOKENIZER), prefix, workers=workers, progress=False)
            return r.tokens, r.worker_cpu_seconds, r.main_cpu_seconds
        return run

    variants = {  # name: (encoding processes or threads, make the input outside the clock, timed call)
        LIMIT: (1, lambda: fresh(tb), in_process(lambda b: raw_sentencepiece(tok, b, 1, True))),
        LISTS: (1, lambda: fresh(tb), in_process(lambda b: raw_sentencepiece(tok, b, 1, False))),
        "raw SentencePiece, 2 threads, numpy ids": (2, lambda: fresh(tb),
                                                    in_process(lambda b: raw_sentencepiece(tok, b, 2, True))),
        OURS1: (1, lambda: None, ours(1, str(tmp / "w1"))),
        OURS2: (2, lambda: None, ours(2, str(tmp / "w2"))),
        "naive loop (json.loads + encode + write per line)":
            (1, lambda: None, in_process(lambda _: naive_loop(tok, corpus, str(tmp / "nv")))),
    }
    one_doc = tmp / "one.jsonl"  # fixed cost of a run: pool start-up, tokenizer load, file set-up
    one_doc.write_text(json.dumps({"text": texts[0]}, ensure_ascii=False) + "\n", encoding="utf-8")
    times = {k: [] for k in variants}
    cpu = {k: [] for k in variants}  # (encoding CPU s, main-process CPU s) per run
    startup = {1: [], 2: []}
    tokens = {}
    load = [os.getloadavg()[0]]
    for rnd in range(repeats + 1):  # round 0 is the warm-up; interleaved, so a disturbance hits all alike
        for name, (_, prepare, run) in variants.items():
            arg = prepare()
            gc.collect()
            t0 = time.perf_counter()
            tokens[name], c_enc, c_main = run(arg)
            t = time.perf_counter() - t0
            del arg
            if rnd:
                times[name].append(t)
                cpu[name].append((c_enc, c_main))
        for w in startup:
            t0 = time.perf_counter()
            preprocess([str(one_doc)], str(TOKENIZER), str(tmp / "one"), workers=w, progress=False)
            if rnd:
                startup[w].append(time.perf_counter() - t0)
        load.append(os.getloadavg()[0])
    assert len(set(tokens.values())) == 1, f"variants disagree on the token count: {tokens}"
    assert (tmp / "w1.bin").read_bytes() == (tmp / "w2.bin").read_bytes() == (tmp / "nv.bin").read_bytes()
    assert (tmp / "w1.idx").read_bytes() == (tmp / "w2.idx").read_bytes() == (tmp / "nv.idx").read_bytes()
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(c for c, _ in v) for k, v in cpu.items()}
    limit, lists = nbytes / med[LIMIT] / 1e6, nbytes / med[LISTS] / 1e6
    st = {w: statistics.median(v) for w, v in startup.items()}
    rows = []
    for name, (procs, _, _) in variants.items():
        mbs = nbytes / med[name] / 1e6
        w = 1 if name == OURS1 else 2 if name == OURS2 else None
        steady = med[name] - (st[w] if w else 0.0)  # the fixed start-up cost taken out (what a large corpus sees)
        rows.append({"variant": name, "procs": procs, "median s": round(med[name], 3),
                     "best s": round(min(times[name]), 3), "runs s": ", ".join(f"{t:.2f}" for t in times[name]),
                     "MB/s": round(mbs, 2), "tokens/s": round(tokens[name] / med[name]),
                     "MB/s per worker": round(mbs / procs, 2), "ratio to limit": round(mbs / procs / limit, 3),
                     "ratio to lists": round(mbs / procs / lists, 3),
                     "ratio without start-up": round(nbytes / steady / 1e6 / procs / limit, 3) if steady > 0 else "n/a",
                     "encoding CPU s": round(med_cpu[name], 2),
                     "main-process CPU s": round(statistics.median(m for _, m in cpu[name]), 2),
                     "CPU ratio to limit": round(med_cpu[LIMIT] / med_cpu[name], 3),
                     "CPU ratio to lists": round(med_cpu[LISTS] / med_cpu[name], 3)})
    paired = [t_lim / t for t_lim, t in zip(times[LIMIT], times[OURS1])]  # one worker vs the limit, round by round
    info = {"paired": [round(x, 3) for x in paired], "paired_median": round(statistics.median(paired), 3),
            "text_MB": round(nbytes / 1e6, 1), "documents": len(texts), "tokens": tokens[LIMIT],
            "repeats": repeats, "startup_s": {w: round(v, 3) for w, v in st.items()},
            "load": [round(x, 2) for x in load]}
    return rows, info


def breakdown(corpus: Path, repeats: int) -> dict:
    """CPU seconds of the worker's steps on the whole corpus, in this process.

    Per chunk, interleaved so that a disturbance hits all alike: parse alone, SentencePiece (numpy ids,
    one thread) on the parsed texts, then the whole worker function (which parses again, so its strings
    are fresh too); the median pass is kept. Then one pass of the worker function under cProfile.
    """
    init_worker(str(TOKENIZER), ParseOptions(), None)
    tok = load_tokenizer(TOKENIZER)
    chunks = list(iter_chunks(expand_inputs([str(corpus)])[0][0], ParseOptions()))
    passes = []
    for _ in range(repeats):
        parse = encode = full = 0.0
        for c in chunks:
            t0 = time.process_time()
            texts = parse_chunk(c, ParseOptions()).texts
            t1 = time.process_time()
            tok.sp.encode(texts, out_type="numpy", add_eos=True, num_threads=1)
            t2 = time.process_time()
            encode_chunk(c)
            t3 = time.process_time()
            parse, encode, full = parse + t1 - t0, encode + t2 - t1, full + t3 - t2
        passes.append((full, parse, encode))
    full, parse, encode = sorted(passes)[len(passes) // 2]
    prof = cProfile.Profile(time.process_time)
    prof.enable()
    for c in chunks:
        encode_chunk(c)
    prof.disable()
    stats = pstats.Stats(prof)
    top = []
    for (file, line, fn), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        where = f"{os.path.relpath(file, REPO) if file.startswith(str(REPO)) else os.path.basename(file)}:{fn}"
        top.append((tottime, where, ncalls, cumtime))
    top.sort(reverse=True)
    return {"parse": round(parse, 2), "encode": round(encode, 2), "rest": round(max(full - parse - encode, 0), 2),
            "full": round(full, 2), "ratio": round(encode / full, 3),
            "profile": [{"function": w, "calls": n, "tottime s": round(t, 3), "cumtime s": round(c, 3)}
                        for t, w, n, c in top[:8]], "profile_total": round(stats.total_tt, 2)}


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
    one, two = by[OURS1], by[OURS2]
    two_vs = two["MB/s"] / by["raw SentencePiece, 2 threads, numpy ids"]["MB/s"]
    met = [one["ratio to limit"] >= 0.85, info["paired_median"] >= 0.85]
    verdict = ("met" if all(met) else "missed" if not any(met) else
               "met by the ratio of medians, missed by the median of round-by-round ratios" if met[0] else
               "missed by the ratio of medians, met by the median of round-by-round ratios")
    b = info["breakdown"]
    prof = table(b["profile"], ["function", "calls", "tottime s", "cumtime s"])
    return f"""## Preprocessing

Measured by `python benchmarks/preprocess.py {' '.join(argv)}` on {host}; load average (1 min) before each
round and at the end: {', '.join(map(str, info['load']))} (the machine is shared: wall times are noisy, compare
rows of one run, not runs). Same text for every row: the embedded People's Daily corpus as `{{"text": ...}}`
jsonl repeated to {info['text_MB']} MB of UTF-8 text ({info['documents']:,} documents, {info['tokens']:,}
tokens with `tokenizers/pd1998-bpe16k`). One untimed warm-up run of every variant, then {info['repeats']}
interleaved rounds; medians. Both sides are timed the same way (wall clock and CPU time around the call that
turns all the text into ids); raw SentencePiece gets fresh strings each run, made before its clock starts.
Every variant produces the same tokens, and ours and the naive loop the same `.bin`/`.idx` bytes (checked).
"ratio to limit" = MB/s per worker / MB/s of raw single-thread SentencePiece with numpy output (the call our
workers make); "ratio to lists" = the same against SentencePiece returning Python lists (the limit of the
earlier measurement, 0.60 for one worker then).

{table(pre, ["variant", "MB/s", "MB/s per worker", "ratio to limit", "ratio to lists", "ratio without start-up",
            "median s", "best s", "runs s"])}

**Goal (one worker >= 0.85 of raw single-thread SentencePiece, wall time): {verdict}, {one['ratio to limit']}**
({one['ratio to lists']} against SentencePiece's list output; {one['ratio without start-up']} without the fixed
start-up; round by round, the limit's time / one worker's time in the same round: {', '.join(map(str, info['paired']))},
median {info['paired_median']}). Each worker runs SentencePiece with one thread; no row of ours uses
SentencePiece's threads.

Median wall time minus median CPU time of the encoding process (time spent waiting for a core, start-up and
the pipeline's fill and drain included): raw single-thread SentencePiece {round(by[LIMIT]['median s'] - by[LIMIT]['encoding CPU s'], 2)} s,
one worker {round(one['median s'] - one['encoding CPU s'], 2)} s.

The same runs by CPU time, which other jobs distort less than wall time: "encoding CPU s" is the CPU time of
the processes (or threads) that parse and encode (for ours: the workers, start-up included), "main-process
CPU s" that of our reading/writing process, "CPU ratio to limit" = raw single-thread SentencePiece CPU s /
encoding CPU s for the same text (1.0 = no overhead per worker).

{table(pre, ["variant", "encoding CPU s", "main-process CPU s", "CPU ratio to limit", "CPU ratio to lists"])}

Where a worker's CPU goes, measured in one process on the same text (`encode_chunk` on every chunk, median
of {info['repeats']} passes): decoding + JSON parsing (orjson) + validation {b['parse']} s, SentencePiece
encoding (numpy output) {b['encode']} s, the rest (one concatenate per chunk, EODs, UTF-8 byte count)
{b['rest']} s; SentencePiece is {b['ratio']} of the worker function's CPU. The functions with the most own time
in one pass under cProfile ({b['profile_total']} s in all, profiler overhead included):

{prof}

Start-up of a `preprocess` run (forkserver pool, worker imports, tokenizer load), measured on a one-document
input: {info['startup_s'][1]} s with 1 worker, {info['startup_s'][2]} s with 2; "ratio without start-up"
subtracts it, which is what a corpus of many GB sees. With 2 workers on 2 cores our main process (reading,
writing) competes with them; in this run 2 workers reach {two_vs:.2f} of raw SentencePiece's 2-thread
throughput.

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
    p.add_argument("--mb", type=float, default=75.0, help="MB of text to encode")
    p.add_argument("--repeats", type=int, default=5)
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
