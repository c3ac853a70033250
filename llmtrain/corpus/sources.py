"""Where documents come from: paths, folders, globs and HF datasets, cut into chunks of raw records.

    python -m llmtrain.corpus.documents PATH [PATH ...]   # count documents and bad records of inputs

:func:`expand_inputs` turns what the user names into :class:`Source` objects:
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

:func:`iter_chunks` (the reading process) cuts each source into ~1 MB :class:`Chunk` s
of raw bytes (line formats) or column values (tables) and knows the line/row number
of each chunk's first record, without parsing anything; :mod:`llmtrain.corpus.parse`
turns a chunk into documents (in worker processes when preprocessing). Memory stays
flat whatever the file size.
"""

from __future__ import annotations

import glob
import gzip
import os
import re
from dataclasses import dataclass
from typing import Iterable, Iterator

from llmtrain.corpus.chunk import Chunk
from llmtrain.corpus.parse import ParseOptions

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
    pos = 0 if src.compression is None else None  # file offset of the start of ``carry`` (plain files)
    with open_binary(src) as f:
        first = True
        while True:
            block = f.read(chunk_bytes)
            if first and block.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark is not text
                block = block[3:]
                pos = 3 if pos is not None else None
            first = False
            buf = carry + block if carry else block
            if not block:
                if buf:
                    yield Chunk(src.path, line, src.fmt, buf, len(buf), pos, buf.count(b"\n"))
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
            newlines = payload.count(b"\n")
            yield Chunk(src.path, line, src.fmt, payload, len(payload), pos, newlines)
            line += newlines
            pos = pos + cut if pos is not None else None


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

