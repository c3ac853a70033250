"""Chunk -> documents: decode, parse, validate and normalise the records of one chunk.

    python -m llmtrain.corpus.documents PATH [PATH ...]   # parses every chunk of the inputs, counts

:func:`parse_chunk` runs where the work is (in ``python -m llmtrain.data.preprocess``'s
worker processes, or in-line for :func:`llmtrain.corpus.documents.iter_documents`) on a
:class:`llmtrain.corpus.chunk.Chunk`. It returns the accepted texts with their line
numbers (and gold word lists, and fingerprints for dedup) and every bad record as
``(kind, line, detail)``; kinds are those of :mod:`llmtrain.corpus.badrecords`.

JSON lines are parsed by ``orjson`` straight from the chunk's bytes (it validates UTF-8
itself). A line ``orjson`` rejects, or whose record is not an object with a string
text, is parsed again the old way (decode, ``json.loads``), so what is accepted, what is
refused and every bad-record message are those of the standard library: ``orjson``
refuses some lines ``json`` takes (``NaN``, a lone surrogate escape, which is then
counted as ``invalid_utf8``) and reads integers beyond 64 bits as floats.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import orjson

from llmtrain.corpus.chunk import Chunk
from llmtrain.corpus.normalize import Normalizer, fingerprint


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

    def utf8_bytes(self) -> int:
        """UTF-8 bytes of the accepted texts. Cheap once the tokenizer has read them (CPython keeps
        the UTF-8 form it made for SentencePiece), so workers call it after encoding."""
        return sum(map(len, map(str.encode, self.texts)))  # str.encode: UTF-8, strict


def _accept(out: Parsed, opt: ParseOptions, text, words, line: int, raw_words: bool,
            surrogates: bool = False) -> None:
    """Validate one record's text (and gold words) and append it, or record why not.

    ``surrogates``: the text may hold lone surrogates (only ``json.loads`` makes them; decoded
    bytes, ``orjson`` and Arrow strings cannot), which are then refused as ``invalid_utf8``."""
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
    if not text or text.isspace():
        return out.bad.append(("empty", line, ""))
    data = None
    if surrogates or out.hashes is not None:
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:
            return out.bad.append(("invalid_utf8", line, f"lone surrogate at character {e.start}"))
    out.texts.append(text)
    out.lines.append(line)
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


def _json_line_stdlib(out: Parsed, opt: ParseOptions, raw: bytes, line: int) -> None:
    """One JSON line the standard-library way: decode, blank check, ``json.loads``, validate."""
    try:
        s = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return out.bad.append(("invalid_utf8", line, f"byte {e.start}"))
    if not s.strip():
        return out.bad.append(("blank_line", line, ""))
    try:
        rec = json.loads(s)
    except ValueError as e:
        return out.bad.append(("malformed_json", line, str(e)))
    if not isinstance(rec, dict):
        return out.bad.append(("not_an_object", line, type(rec).__name__))
    want_words = opt.words_key is not None
    _accept(out, opt, rec.get(opt.key), rec.get(opt.words_key) if want_words else None, line, want_words,
            surrogates=True)


def _json_lines(out: Parsed, opt: ParseOptions, payload: bytes, first_line: int) -> None:
    raw_lines = payload.split(b"\n")
    if raw_lines and raw_lines[-1] == b"":
        raw_lines.pop()
    loads, key, words_key = orjson.loads, opt.key, opt.words_key
    # the common case (no normalisation, words or fingerprints) is checked in-line
    plain = words_key is None and not opt.normalizer.active and out.hashes is None
    texts, lines = out.texts, out.lines
    for i, raw in enumerate(raw_lines, first_line):
        try:
            rec = loads(raw)
        except orjson.JSONDecodeError:
            _json_line_stdlib(out, opt, raw, i)
            continue
        text = rec.get(key) if type(rec) is dict else None
        if type(text) is not str:  # not an object, no text, not a string: the exact message from json
            _json_line_stdlib(out, opt, raw, i)
        elif plain:
            if text and "\x00" not in text and not text.isspace():
                texts.append(text)
                lines.append(i)
            else:
                _accept(out, opt, text, None, i, False)
        else:
            _accept(out, opt, text, rec.get(words_key) if words_key else None, i, words_key is not None)


def parse_chunk(chunk: Chunk, opt: ParseOptions) -> Parsed:
    """Decode, parse, validate and normalise the records of one chunk."""
    out = Parsed(words=[] if opt.words_key else None, hashes=[] if opt.fingerprints else None)
    want_words = opt.words_key is not None
    payload = chunk.data()
    if chunk.fmt == "records":
        texts = payload[opt.key]
        words = payload.get(opt.words_key) if want_words else None
        for i, text in enumerate(texts):
            _accept(out, opt, text, words[i] if want_words else None, chunk.first_line + i, want_words)
        return out
    if chunk.fmt == "jsonl":
        _json_lines(out, opt, payload, chunk.first_line)
    elif opt.text_mode == "line":
        for i, s in enumerate(_decode_lines(payload, chunk.first_line, out.bad)):
            if s is not None:
                _accept(out, opt, s.rstrip("\r"), None, chunk.first_line + i, False)
    else:  # "para": blank-line separated; a paragraph with an undecodable line is counted once
        cur: list[str] | None = []  # None: the current paragraph had an invalid line
        start = 0
        for i, s in enumerate(_decode_lines(payload, chunk.first_line, out.bad)):
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
