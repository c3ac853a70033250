"""The unit of work between reading a corpus and parsing it: a slice of one source.

    python -m llmtrain.corpus.documents PATH [PATH ...]

`llmtrain.corpus.sources` cuts each source into chunks (the reading process);
`llmtrain.corpus.parse` turns one chunk into documents (in worker processes), and
`llmtrain.data.encoding` tokenizes one. A chunk sent to a worker travels by reference
when its bytes can be read again from the file.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass
class Chunk:
    """A slice of one source: raw bytes of whole lines, or table column values."""

    label: str  # file name used in messages
    first_line: int  # 1-based line (or row) number of the first record
    fmt: str  # jsonl | text | records
    payload: bytes | dict | None  # bytes for jsonl/text; {column: list} for records; None: by_reference()
    nbytes: int  # raw bytes (line formats) or characters (tables), for the progress bar
    offset: int | None = None  # where the bytes start in the file ``label`` (uncompressed files only)
    newlines: int = 0  # b"\n" in the bytes (line formats)

    def by_reference(self) -> "Chunk":
        """The same chunk without its bytes when they can be read again from an uncompressed file
        (what is sent to a worker process: a few numbers instead of a megabyte through a pipe)."""
        if self.offset is None or not isinstance(self.payload, bytes):
            return self
        return Chunk(self.label, self.first_line, self.fmt, None, self.nbytes, self.offset, self.newlines)

    def data(self) -> bytes | dict:
        """The payload; read from the file (and checked against what was cut) for a chunk by reference."""
        if self.payload is not None:
            return self.payload
        with open(self.label, "rb") as f:
            data = os.pread(f.fileno(), self.nbytes, self.offset)
        if len(data) != self.nbytes or data.count(b"\n") != self.newlines:
            raise RuntimeError(f"{self.label}: changed while being read (bytes {self.offset}.."
                               f"{self.offset + self.nbytes} differ from what was cut into chunks)")
        return data
