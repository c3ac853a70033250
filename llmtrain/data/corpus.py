"""Corpus ingestion: files, folders, globs and local HF datasets -> documents.

    python -m llmtrain.data.corpus PATH [PATH ...] [--json-key text] [--text-mode line|para]

(the command above counts documents and bad records without writing anything.)

Inputs, each expanded by :func:`expand_inputs` into :class:`Source` objects:
  * ``*.jsonl`` / ``*.json`` / ``*.ndjson``  one JSON object per line, text under ``key``;
  * ``*.txt``  one document per line (``text_mode="line"``) or documents separated
    by blank lines (``text_mode="para"``);
  * ``*.parquet``  the ``key`` column;
  * any of the line formats compressed as ``.gz`` or ``.zst``/``.zstd``;
  * a folder (walked recursively, sorted; files of other types are listed as skipped),
    or a glob pattern (sorted);
  * a folder written by ``datasets`` ``save_to_disk`` (detected by its
    ``dataset_info.json``/``dataset_dict.json``; read with ``load_from_disk``), or
    ``hf:json:GLOB``, ``hf:parquet:GLOB``, ``hf:text:GLOB`` for
    ``datasets.load_dataset(builder, data_files=..., streaming=True)``.

Reading is split in two so that the heavy part runs in worker processes:
:func:`iter_chunks` (main process) cuts each source into ~1 MB :class:`Chunk` s of
raw bytes (line formats) or column values (tables) and knows the line/row number
of each chunk's first record; :func:`parse_chunk` (workers) decodes, parses,
validates and normalises them and returns the documents plus the bad records
with their line numbers. Memory stays flat whatever the file size.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from llmtrain.data.badrecords import BadRecords
from llmtrain.data.normalize import Normalizer, fingerprint

_EXT = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".txt": "text",
        ".text": "text", ".parquet": "parquet"}
_COMP = {".gz": "gzip", ".gzip": "gzip", ".zst": "zstd", ".zstd": "zstd"}
_BLANK_SEP = re.compile(rb"\n[ \t\r]*\n")
CHUNK_BYTES = 1 << 20
CHUNK_ROWS = 2048


@dataclass(frozen=True)
class Source:
    """One readable input: a file, a saved HF dataset, or a load_dataset() spec."""

    path: str
    fmt: str  # jsonl | text | parquet | hf_disk | hf_load
    compression: str | None = None  # gzip | zstd
    builder: str | None = None  # hf_load: json | parquet | text
    files: tuple[str, ...] = ()  # hf_load data_files


@dataclass
class Chunk:
    """A slice of one source: raw bytes of whole lines, or table column values."""

    label: str  # file name used in messages
    first_line: int  # 1-based line (or row) number of the first record
    fmt: str  # jsonl | text | records
    payload: bytes | dict  # bytes for jsonl/text; {column: list} for records
    nbytes: int  # raw bytes (line formats) or characters (tables), for the progress bar


@dataclass(frozen=True)
class ParseOptions:
    key: str = "text"
    """JSON field / table column holding the text."""
    text_mode: str = "line"
    """Plain text: ``line`` = one document per line, ``para`` = blank-line separated."""
    words_key: str | None = None
    """Field with the gold word list (must join to the text), or None."""
    normalizer: Normalizer = field(default_factory=Normalizer)
    fingerprints: bool = False
    """Also return a 64-bit fingerprint per document (for exact dedup)."""


@dataclass
class Parsed:
    """What a worker gets out of one chunk (documents in file order)."""

    texts: list[str] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    words: list[list[str]] | None = None
    hashes: list[int] | None = None
    bad: list[tuple[str, int, str]] = field(default_factory=list)  # (kind, line, detail)
    nbytes: int = 0  # UTF-8 bytes of the accepted texts


@dataclass
class Document:
    text: str
    label: str
    line: int
    words: list[str] | None = None


# ---------------------------------------------------------------- expansion
def _classify(path: str, fmt: str = "auto") -> Source | None:
    name = path.lower()
    comp = None
    for ext, c in _COMP.items():
        if name.endswith(ext):
            comp, name = c, name[: -len(ext)]
            break
    kind = fmt if fmt != "auto" else _EXT.get(os.path.splitext(name)[1])
    if kind is None:
        return None
    if kind == "parquet" and comp:
        raise ValueError(f"{path}: compressed parquet is not supported (parquet compresses internally)")
    return Source(path, kind, comp)


def _is_saved_dataset(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in ("dataset_info.json", "dataset_dict.json"))


def expand_inputs(inputs: Iterable[str], fmt: str = "auto") -> tuple[list[Source], list[str]]:
    """Expand paths, folders, globs and ``hf:`` specs; return (sources, skipped files)."""
    sources, skipped = [], []
    for item in inputs:
        item = str(item)
        if item.startswith("hf:"):
            parts = item.split(":", 2)
            if len(parts) != 3 or parts[1] not in ("json", "parquet", "text"):
                raise ValueError(f"input {item!r}: expected hf:json:GLOB, hf:parquet:GLOB or hf:text:GLOB")
            files = tuple(sorted(glob.glob(parts[2], recursive=True)))
            if not files:
                raise FileNotFoundError(f"input {item!r}: no file matches {parts[2]!r}")
            sources.append(Source(parts[2], "hf_load", builder=parts[1], files=files))
            continue
        if any(c in item for c in "*?[") and not os.path.exists(item):
            matches = sorted(glob.glob(item, recursive=True))
            if not matches:
                raise FileNotFoundError(f"input {item!r}: the glob matches no file")
        elif not os.path.exists(item):
            raise FileNotFoundError(f"input {item!r} does not exist")
        else:
            matches = [item]
        for m in matches:
            if os.path.isdir(m) and _is_saved_dataset(m):
                sources.append(Source(m, "hf_disk"))
            elif os.path.isdir(m):  # every file below, in sorted path order (like `find | sort`)
                found = []
                for root, dirs, files in os.walk(m):
                    dirs[:] = [d for d in dirs if not d.startswith(".")]
                    if _is_saved_dataset(root):
                        found.append((root, Source(root, "hf_disk")))
                        dirs[:] = []
                        continue
                    found += [(os.path.join(root, f), _classify(os.path.join(root, f), fmt))
                              for f in files if not f.startswith(".")]
                for p, src in sorted(found, key=lambda x: x[0]):
                    (sources.append(src) if src else skipped.append(p))
            else:
                src = _classify(m, fmt)
                if src is None:
                    raise ValueError(f"input {m!r}: unknown file type; use .jsonl/.json/.txt/.parquet "
                                     f"(optionally .gz/.zst) or pass --format")
                sources.append(src)
    return sources, skipped


# ---------------------------------------------------------------- reading (main process)
def open_binary(src: Source):
    if src.compression == "gzip":
        return gzip.open(src.path, "rb")
    if src.compression == "zstd":
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(open(src.path, "rb"), read_across_frames=True,
                                                          closefd=True)
    return open(src.path, "rb")


def _line_chunks(src: Source, text_mode: str, chunk_bytes: int) -> Iterator[Chunk]:
    para = src.fmt == "text" and text_mode == "para"
    line, carry = 1, b""
    with open_binary(src) as f:
        first = True
        while True:
            block = f.read(chunk_bytes)
            if first and block.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark is not text
                block = block[3:]
            first = False
            buf = carry + block if carry else block
            if not block:
                if buf:
                    yield Chunk(src.path, line, src.fmt, buf, len(buf))
                return
            if para:
                cut = 0
                for m in _BLANK_SEP.finditer(buf, max(0, len(carry) - 64)):
                    cut = m.end()
            else:
                cut = buf.rfind(b"\n") + 1
            if cut == 0:
                carry = buf
                continue
            payload, carry = buf[:cut], buf[cut:]
            yield Chunk(src.path, line, src.fmt, payload, len(payload))
            line += payload.count(b"\n")


def _table_chunks(label: str, batches, cols: list[str]) -> Iterator[Chunk]:
    """Batches are dicts {column: list}; a column absent from the table becomes Nones."""
    row = 1
    for batch in batches:
        n = len(next(iter(batch.values()))) if batch else 0
        values = {c: batch[c] if c in batch else [None] * n for c in cols}
        nbytes = sum(len(t) for t in values[cols[0]] if isinstance(t, str))  # characters, approx.
        yield Chunk(label, row, "records", values, nbytes)
        row += n


def iter_chunks(src: Source, opt: ParseOptions, chunk_bytes: int = CHUNK_BYTES) -> Iterator[Chunk]:
    """Cut one source into chunks of whole records (never splits a record)."""
    cols = [opt.key] + ([opt.words_key] if opt.words_key else [])
    if src.fmt in ("jsonl", "text"):
        yield from _line_chunks(src, opt.text_mode, chunk_bytes)
    elif src.fmt == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(src.path)
        have = [c for c in cols if c in pf.schema_arrow.names]
        if have:
            batches = (b.to_pydict() for b in pf.iter_batches(batch_size=CHUNK_ROWS, columns=have))
        else:  # the column is missing: every row is a bad record, counted per row
            n = pf.metadata.num_rows
            batches = ({"": [None] * min(CHUNK_ROWS, n - i)} for i in range(0, n, CHUNK_ROWS))
        yield from _table_chunks(src.path, batches, cols)
    elif src.fmt in ("hf_disk", "hf_load"):
        import datasets

        if src.fmt == "hf_disk":
            ds = datasets.load_from_disk(src.path)
            parts = sorted(ds.items()) if isinstance(ds, datasets.DatasetDict) else [(None, ds)]
        else:
            ds = datasets.load_dataset(src.builder, data_files=list(src.files), split="train", streaming=True)
            parts = [(None, ds)]
        for split, d in parts:
            label = src.path + (f"[{split}]" if split else "")
            yield from _table_chunks(label, d.iter(batch_size=CHUNK_ROWS), cols)
    else:
        raise ValueError(f"{src.path}: unknown source format {src.fmt!r}")


# ---------------------------------------------------------------- parsing (workers)
def _accept(out: Parsed, opt: ParseOptions, text, words, line: int, raw_words: bool) -> None:
    """Validate one record's text (and gold words) and append it, or record why not."""
    if text is None:
        return out.bad.append(("missing_field", line, f"no {opt.key!r}"))
    if not isinstance(text, str):
        return out.bad.append(("non_string_field", line, f"{opt.key!r} is {type(text).__name__}"))
    if "\x00" in text:
        return out.bad.append(("nul_byte", line, ""))
    if raw_words:
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            return out.bad.append(("missing_field", line, f"{opt.words_key!r} is not a list of strings"))
        if "".join(words) != text:
            return out.bad.append(("words_mismatch", line, f"{opt.words_key!r} does not join to {opt.key!r}"))
    norm = opt.normalizer
    if norm.active:
        if raw_words:
            words = [norm(w) for w in words]
            text = "".join(words)
        else:
            text = norm(text)
    if not text.strip():
        return out.bad.append(("empty", line, ""))
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as e:
        return out.bad.append(("invalid_utf8", line, f"lone surrogate at character {e.start}"))
    out.texts.append(text)
    out.lines.append(line)
    out.nbytes += len(data)
    if out.words is not None:
        out.words.append([w for w in words if w])
    if out.hashes is not None:
        out.hashes.append(fingerprint(data))


def _decode_lines(payload: bytes, first_line: int, bad: list) -> list[str | None]:
    """Lines of a chunk as str (decoded in one call); undecodable lines become None + a bad record."""
    try:
        lines: list[str | None] = payload.decode("utf-8").split("\n")
    except UnicodeDecodeError:
        lines = []
        for i, raw in enumerate(payload.split(b"\n")):
            try:
                lines.append(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                bad.append(("invalid_utf8", first_line + i, f"byte {e.start}"))
                lines.append(None)
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def parse_chunk(chunk: Chunk, opt: ParseOptions) -> Parsed:
    """Decode, parse, validate and normalise the records of one chunk."""
    out = Parsed(words=[] if opt.words_key else None, hashes=[] if opt.fingerprints else None)
    want_words = opt.words_key is not None
    if chunk.fmt == "records":
        texts = chunk.payload[opt.key]
        words = chunk.payload.get(opt.words_key) if want_words else None
        for i, text in enumerate(texts):
            _accept(out, opt, text, words[i] if want_words else None, chunk.first_line + i, want_words)
        return out
    lines = _decode_lines(chunk.payload, chunk.first_line, out.bad)
    if chunk.fmt == "jsonl":
        for i, s in enumerate(lines):
            if s is None:
                continue
            line = chunk.first_line + i
            if not s.strip():
                out.bad.append(("blank_line", line, ""))
                continue
            try:
                rec = json.loads(s)
            except ValueError as e:
                out.bad.append(("malformed_json", line, str(e)))
                continue
            if not isinstance(rec, dict):
                out.bad.append(("not_an_object", line, type(rec).__name__))
                continue
            _accept(out, opt, rec.get(opt.key), rec.get(opt.words_key) if want_words else None,
                    line, want_words)
    elif opt.text_mode == "line":
        for i, s in enumerate(lines):
            if s is not None:
                _accept(out, opt, s.rstrip("\r"), None, chunk.first_line + i, False)
    else:  # "para": blank-line separated; a paragraph with an undecodable line is counted once
        cur: list[str] | None = []  # None: the current paragraph had an invalid line
        start = 0
        for i, s in enumerate(lines):
            line = chunk.first_line + i
            if s is None:
                cur = None
            elif not s.strip():
                if cur:
                    _accept(out, opt, "\n".join(cur), None, start, False)
                cur = []
            elif cur is not None:
                if not cur:
                    start = line
                cur.append(s.rstrip("\r"))
        if cur:
            _accept(out, opt, "\n".join(cur), None, start, False)
    if len(out.bad) > 1:
        out.bad.sort(key=lambda b: b[1])
    return out


def iter_documents(inputs: Iterable[str], opt: ParseOptions = ParseOptions(), bad: BadRecords | None = None,
                   dedup: bool = False, fmt: str = "auto") -> Iterator[Document]:
    """Single-process document stream over all inputs, in order; bad records go to ``bad``."""
    bad = bad if bad is not None else BadRecords()
    if dedup and not opt.fingerprints:
        opt = ParseOptions(opt.key, opt.text_mode, opt.words_key, opt.normalizer, True)
    seen: set[int] = set()
    sources, _ = expand_inputs(inputs, fmt)
    for src in sources:
        for chunk in iter_chunks(src, opt):
            p = parse_chunk(chunk, opt)
            for kind, line, detail in p.bad:
                bad.add(kind, chunk.label, line, detail)
            for i, text in enumerate(p.texts):
                if dedup:
                    if p.hashes[i] in seen:
                        bad.add("duplicate", chunk.label, p.lines[i])
                        continue
                    seen.add(p.hashes[i])
                yield Document(text, chunk.label, p.lines[i], p.words[i] if p.words is not None else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Count documents and bad records of a corpus (writes nothing).")
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--json-key", default="text")
    ap.add_argument("--text-mode", choices=["line", "para"], default="line")
    ap.add_argument("--format", default="auto", choices=["auto", "jsonl", "text", "parquet"])
    ap.add_argument("--dedup", action="store_true")
    a = ap.parse_args(argv)
    bad = BadRecords()
    n = chars = 0
    for doc in iter_documents(a.inputs, ParseOptions(a.json_key, a.text_mode), bad, a.dedup, a.format):
        n += 1
        chars += len(doc.text)
    print(f"{n} documents, {chars} characters\n{bad.report()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
