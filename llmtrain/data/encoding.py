"""Worker side of preprocessing: parse, validate and tokenize one chunk of input.

    python -m llmtrain.data.preprocess --input PATH --tokenizer DIR --output-prefix PREFIX --workers N

:mod:`llmtrain.data.preprocess` runs :func:`encode_chunk` in ``N`` processes forked
from a fork server that has imported this module (and so numpy and sentencepiece)
once; :func:`init_worker` loads the tokenizer in each. It lives apart from the
command's module so that workers never re-run the command's code.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass

import numpy as np

from llmtrain.corpus.parse import ParseOptions, parse_chunk
from llmtrain.corpus.sources import Chunk
from llmtrain.data.wordbound import WordSegmenter, word_start_flags
from llmtrain.tokenizer import load_tokenizer


@dataclass
class Encoded:
    """One chunk after a worker: documents as tokens (each ending in EOD)."""

    label: str
    tokens: np.ndarray  # [n_tokens] ids, documents back to back
    lengths: np.ndarray  # [n_docs] int32, EOD included
    lines: np.ndarray  # [n_docs] line of each document
    text_bytes: int
    raw_bytes: int
    bad: list  # (kind, line, detail)
    hashes: list | None = None  # [n_docs] fingerprints (dedup)
    wbd: np.ndarray | None = None  # [n_tokens] uint8 word-start flags
    cpu: tuple[int, float] = (0, 0.0)  # (worker pid, its CPU seconds so far)


_STATE: dict = {}


def init_worker(tokenizer_dir: str, opt: ParseOptions, word_boundaries: str | None) -> None:
    _STATE["tok"] = load_tokenizer(tokenizer_dir)
    _STATE["opt"] = opt
    _STATE["seg"] = WordSegmenter(word_boundaries) if word_boundaries else None
    if word_boundaries:
        _STATE["tok"].token_nbytes  # build the table once per worker


def encode_chunk(chunk: Chunk) -> Encoded:
    """Parse and tokenize one chunk (runs in a worker)."""
    tok, opt, seg = _STATE["tok"], _STATE["opt"], _STATE["seg"]
    p = parse_chunk(chunk, opt)
    ids = tok.encode_batch(p.texts, num_threads=1)
    n_docs = len(ids)
    lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int32, count=n_docs)  # [n_docs]
    total = int(lengths.sum(dtype=np.int64))
    tokens = np.empty(total, dtype=tok.dtype)  # [n_tokens]
    eod_pos = np.cumsum(lengths, dtype=np.int64) - 1  # [n_docs] position of each EOD
    is_text = np.ones(total, dtype=bool)
    is_text[eod_pos] = False
    tokens[is_text] = np.fromiter(itertools.chain.from_iterable(ids), dtype=tok.dtype, count=total - n_docs)
    tokens[eod_pos] = tok.eod_id
    wbd = None
    if seg is not None:
        wbd = np.ones(total, dtype=np.uint8)
        for i, (x, text) in enumerate(zip(ids, p.texts)):
            words = seg.words(text, p.words[i] if p.words is not None else None)
            start = int(eod_pos[i]) - len(x)
            wbd[start: start + len(x)] = word_start_flags(tok, x, text, words)
    return Encoded(chunk.label, tokens, lengths, np.asarray(p.lines, dtype=np.int64), p.nbytes,
                   chunk.nbytes, p.bad, p.hashes, wbd, (os.getpid(), time.process_time()))
