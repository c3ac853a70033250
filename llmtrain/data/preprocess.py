"""Tokenize a corpus into MMIDIDX token files, in parallel, streaming.

    python -m llmtrain.data.preprocess --input PATH [PATH ...] --tokenizer DIR --output-prefix PREFIX \\
        [--workers N] [--json-key text] [--text-mode line|para] [--strict] [--dedup] \\
        [--nfkc] [--fullwidth-ascii] [--strip-control] [--word-boundaries jieba|gold [--words-key words]]
    python -m llmtrain.data.preprocess merge --inputs PREFIX_A PREFIX_B ... --output-prefix PREFIX

Writes ``PREFIX.bin``/``PREFIX.idx`` (Megatron/PaddleNLP MMIDIDX: uint16 ids when the
padded vocabulary has at most 65536 entries, else int32; one item per document
with one EOD after it), ``PREFIX.meta.json`` (tokenizer identity, inputs, options,
counts, bad records) and, with ``--word-boundaries``, ``PREFIX.wbd`` (one uint8 per
token, 1 where the token starts a word; see :mod:`llmtrain.data.wordbound`).

Pipeline: the main process cuts the inputs into ~1 MB chunks of whole records
(:func:`llmtrain.corpus.sources.iter_chunks`, no parsing), ``--workers`` processes
parse, validate, normalise and encode them (:func:`llmtrain.data.encoding.encode_chunk`:
orjson, then SentencePiece's batch encoder into one numpy array per chunk, one thread
each) and the main process writes the results in input order. At most
``2 * workers + 2`` chunks are in flight, so memory stays flat whatever the input
size. ``--workers 0`` runs everything in the main process. A progress bar shows
MB read, documents/s, MB/s and tokens/s; the final report lists documents,
tokens, and bad records by kind with the file:line of the first few of each. Inputs that hold no document at all
(empty files, or every record bad) write nothing and exit with status 1, naming the files and the counts.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from llmtrain.corpus.badrecords import BadRecordError, BadRecords
from llmtrain.corpus.normalize import Normalizer
from llmtrain.corpus.parse import ParseOptions
from llmtrain.corpus.sources import expand_inputs, iter_chunks
from llmtrain.data import indexed
from llmtrain.data.encoding import encode_chunk, init_worker
from llmtrain.tokenizer import load_tokenizer


# ---------------------------------------------------------------- main side
@dataclass
class Report:
    output_prefix: str
    documents: int = 0
    tokens: int = 0
    text_bytes: int = 0
    raw_bytes: int = 0
    seconds: float = 0.0
    workers: int = 0
    worker_cpu_seconds: float = 0.0  # CPU time of the encoding processes (the main process when inline)
    main_cpu_seconds: float = 0.0  # CPU time of the main process (reading, writing)
    bad: BadRecords = field(default_factory=BadRecords)
    skipped_files: list = field(default_factory=list)

    def summary(self) -> str:
        s = max(self.seconds, 1e-9)
        lines = [f"{self.output_prefix}.{{bin,idx}}: {self.documents} documents, {self.tokens} tokens "
                 f"({self.tokens / max(self.documents, 1):.1f}/document), {self.text_bytes / 1e6:.1f} MB of text "
                 f"in {self.seconds:.1f} s with {self.workers} worker(s): {self.documents / s:.0f} docs/s, "
                 f"{self.text_bytes / 1e6 / s:.2f} MB/s, {self.tokens / s:.0f} tokens/s; CPU: workers "
                 f"{self.worker_cpu_seconds:.1f} s, main process {self.main_cpu_seconds:.1f} s",
                 self.bad.report()]
        if self.skipped_files:
            lines.append(f"skipped {len(self.skipped_files)} file(s) of unknown type: "
                         + ", ".join(self.skipped_files[:5]) + (" ..." if len(self.skipped_files) > 5 else ""))
        return "\n".join(lines)


class EmptyCorpusError(ValueError):
    """The inputs hold no document (empty, or every record bad): the message names the files and the counts."""


def _results(chunks, workers: int, init_args: tuple):
    """Encoded chunks in input order, from ``workers`` processes with a bounded window."""
    if workers == 0:
        init_worker(*init_args)
        yield from map(encode_chunk, chunks)
        return
    ctx = mp.get_context("forkserver")  # safe even if the caller has threads (fork is not)
    # the fork server imports the worker module (numpy, sentencepiece) once; workers fork from it
    ctx.set_forkserver_preload(["llmtrain.data.encoding"])
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=init_worker, initargs=init_args) as pool:
        window: collections.deque = collections.deque()
        try:
            for chunk in chunks:
                window.append(pool.submit(encode_chunk, chunk.by_reference()))  # the worker reads plain files
                if len(window) >= 2 * workers + 2:
                    yield window.popleft().result()
            while window:
                yield window.popleft().result()
        finally:  # stopped early (strict mode, Ctrl-C): drop the chunks not started yet
            pool.shutdown(wait=True, cancel_futures=True)


def preprocess(inputs: list[str], tokenizer: str, output_prefix: str, workers: int | None = None,
               opt: ParseOptions = ParseOptions(), dedup: bool = False, strict: bool = False,
               word_boundaries: str | None = None, fmt: str = "auto", chunk_bytes: int = 1 << 20,
               progress: bool | None = None, command: str | None = None) -> Report:
    """Tokenize ``inputs`` into ``output_prefix``; return the report (raises BadRecordError if strict)."""
    from tqdm import tqdm

    if workers is None:
        workers = os.cpu_count() or 1
    tok = load_tokenizer(tokenizer)
    if word_boundaries == "gold" and not opt.words_key:
        raise ValueError("--word-boundaries gold needs --words-key (the field with the word list)")
    if dedup and not opt.fingerprints:
        opt = ParseOptions(opt.key, opt.text_mode, opt.words_key, opt.normalizer, True)
    sources, skipped = expand_inputs(inputs, fmt)
    if not sources:
        raise FileNotFoundError(f"no readable input in {inputs}")
    report = Report(output_prefix, workers=workers, bad=BadRecords(strict=strict), skipped_files=skipped)
    sized = all(s.fmt in ("jsonl", "text") and not s.compression for s in sources)
    total = sum(os.path.getsize(s.path) for s in sources) if sized else None
    writer = indexed.IndexedWriter(output_prefix, tok.dtype, side=("wbd",) if word_boundaries else ())
    seen: set[int] = set()
    chunks = (c for s in sources for c in iter_chunks(s, opt, chunk_bytes))
    t0 = last = time.time()
    cpu0 = time.process_time()
    worker_cpu: dict[int, float] = {}
    bar = tqdm(total=total, unit="B", unit_scale=True, disable=(None if progress is None else not progress),
               desc=os.path.basename(output_prefix), dynamic_ncols=True)
    results = _results(chunks, workers, (tokenizer, opt, word_boundaries))
    try:
        for r in results:
            for kind, line, detail in r.bad:
                report.bad.add(kind, r.label, line, detail)
            tokens, lengths, wbd = r.tokens, r.lengths, r.wbd
            if dedup:
                keep = np.ones(len(lengths), dtype=bool)
                for i, h in enumerate(r.hashes):
                    if h in seen:
                        keep[i] = False
                        report.bad.add("duplicate", r.label, int(r.lines[i]))
                    else:
                        seen.add(h)
                if not keep.all():
                    mask = np.repeat(keep, lengths)
                    tokens, lengths = tokens[mask], lengths[keep]
                    wbd = wbd[mask] if wbd is not None else None
            writer.add_documents(tokens, lengths, {"wbd": wbd} if wbd is not None else None)
            report.documents += len(lengths)
            report.tokens += len(tokens)
            report.text_bytes += r.text_bytes
            report.raw_bytes += r.raw_bytes
            worker_cpu[r.cpu[0]] = r.cpu[1]
            bar.update(r.raw_bytes)
            now = time.time()
            if now - last > 0.5:
                dt = now - t0
                bar.set_postfix_str(f"docs={report.documents} {report.documents / dt:.0f} docs/s "
                                    f"{report.text_bytes / 1e6 / dt:.2f} MB/s {report.tokens / dt:.0f} tok/s",
                                    refresh=False)
                last = now
    except BaseException:
        results.close()
        bar.close()
        writer.abort()
        raise
    bar.close()
    if report.documents == 0:  # nothing a run could train on: no output files, an error with the counts
        writer.abort()
        raise EmptyCorpusError(
            f"{', '.join(s.path for s in sources)}: no document to write ({report.raw_bytes} bytes read); nothing "
            f"was written at {output_prefix}.{{bin,idx}}\n{report.bad.report()}"
            + (f"\nskipped {len(skipped)} file(s) of unknown type: {', '.join(skipped[:5])}" if skipped else ""))
    writer.finalize()
    report.seconds = time.time() - t0
    report.main_cpu_seconds = time.process_time() - cpu0
    report.worker_cpu_seconds = (report.main_cpu_seconds if workers == 0 else
                                 sum(worker_cpu.values()))  # includes each worker's start-up
    meta = {"format": "llmtrain-mmidx/1", "tokenizer": tok.identity(), "dtype": np.dtype(tok.dtype).name,
            "inputs": [s.path for s in sources], "skipped_files": skipped, "json_key": opt.key,
            "text_mode": opt.text_mode, "normalizer": vars(opt.normalizer), "dedup": dedup,
            "word_boundaries": word_boundaries, "words_key": opt.words_key, "documents": report.documents,
            "tokens": report.tokens, "text_bytes": report.text_bytes, "seconds": round(report.seconds, 3),
            "cpu_seconds": {"workers": round(report.worker_cpu_seconds, 3), "main": round(report.main_cpu_seconds, 3)},
            "bad_records": report.bad.to_dict(), "command": command}
    with open(output_prefix + ".meta.json", "w", encoding="utf-8") as f:
        json.dump(meta, f, ensure_ascii=False, indent=2)
        f.write("\n")
    return report


def _merge_main(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m llmtrain.data.preprocess merge",
                                description="Concatenate MMIDIDX shards (same dtype) into one prefix.")
    p.add_argument("--inputs", nargs="+", required=True, help="shard prefixes, in order")
    p.add_argument("--output-prefix", required=True)
    a = p.parse_args(argv)
    ds = indexed.merge(a.inputs, a.output_prefix)
    metas = [f"{x}.meta.json" for x in a.inputs]
    if all(os.path.isfile(m) for m in metas):
        ms = [json.load(open(m)) for m in metas]
        if len({m["tokenizer"]["sha256"] for m in ms}) > 1:
            print("warning: the shards were made with different tokenizers", file=sys.stderr)
        merged = dict(ms[0], documents=ds.n_docs, tokens=ds.n_tokens, merged_from=a.inputs,
                      inputs=[i for m in ms for i in m["inputs"]])
        with open(a.output_prefix + ".meta.json", "w", encoding="utf-8") as f:
            json.dump(merged, f, ensure_ascii=False, indent=2)
    print(f"{a.output_prefix}: {ds.n_docs} documents, {ds.n_tokens} tokens from {len(a.inputs)} shards",
          file=sys.stderr)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["merge"]:
        return _merge_main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m llmtrain.data.preprocess", description=__doc__.split("\n\n")[0],
                                epilog="Merge shards: python -m llmtrain.data.preprocess merge --inputs A B "
                                       "--output-prefix C")
    p.add_argument("--input", nargs="+", required=True, help="files, folders, globs, hf:BUILDER:GLOB")
    p.add_argument("--tokenizer", required=True, help="tokenizer directory (llmtrain.tokenizer.train output)")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx, PREFIX.meta.json")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="encoding processes (0 = inline)")
    p.add_argument("--json-key", default="text", help="text field (jsonl) or column (parquet, HF datasets)")
    p.add_argument("--text-mode", choices=["line", "para"], default="line",
                   help="plain text: one document per line, or blank-line separated documents")
    p.add_argument("--format", choices=["auto", "jsonl", "text", "parquet"], default="auto",
                   help="force the format of files given explicitly")
    p.add_argument("--strict", action="store_true", help="stop at the first bad record (file:line)")
    p.add_argument("--dedup", action="store_true", help="drop exact duplicate documents (counted)")
    p.add_argument("--nfkc", action="store_true", help="Unicode NFKC normalisation")
    p.add_argument("--fullwidth-ascii", action="store_true", help="full-width ASCII forms to half-width")
    p.add_argument("--strip-control", action="store_true", help="remove control characters but \\t and \\n")
    p.add_argument("--word-boundaries", choices=["jieba", "gold"], default=None,
                   help="also write PREFIX.wbd: 1 per token that starts a word")
    p.add_argument("--words-key", default=None, help="field with the gold word list (--word-boundaries gold)")
    p.add_argument("--chunk-mb", type=float, default=1.0, help="MB of input per work unit")
    p.add_argument("--progress", choices=["auto", "on", "off"], default="auto")
    a = p.parse_args(argv)
    if a.word_boundaries == "gold" and not a.words_key:
        a.words_key = "words"
    opt = ParseOptions(a.json_key, a.text_mode, a.words_key,
                       Normalizer(a.nfkc, a.fullwidth_ascii, a.strip_control))
    command = "python -m llmtrain.data.preprocess " + " ".join(shlex.quote(x) for x in argv)
    try:
        report = preprocess(a.input, a.tokenizer, a.output_prefix, a.workers, opt, a.dedup, a.strict,
                            a.word_boundaries, a.format, int(a.chunk_mb * (1 << 20)),
                            {"auto": None, "on": True, "off": False}[a.progress], command)
    except BadRecordError as e:
        print(f"error (--strict): {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as e:  # EmptyCorpusError too: the files and the counts
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(report.summary(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
