"""Worker side of preprocessing: parse, validate and tokenize one chunk of input.

    python -m llmtrain.data.preprocess --input PATH --tokenizer DIR --output-prefix PREFIX --workers N

:mod:`llmtrain.data.preprocess` runs :func:`encode_chunk` in ``N`` processes forked
from a fork server that has imported this module (and so numpy and sentencepiece)
once; :func:`init_worker` loads the tokenizer in each. It lives apart from the
command's module so that workers never re-run the command's code.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from llmtrain.corpus.parse import ParseOptions, parse_chunk
from llmtrain.corpus.chunk import Chunk
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
    tokens, lengths = tok.encode_documents(p.texts, num_threads=1)  # [n_tokens], [n_docs] (EODs included)
    wbd = None
    if seg is not None:
        wbd = np.ones(len(tokens), dtype=np.uint8)  # [n_tokens]; EODs stay 1
        start = 0
        for i, (n, text) in enumerate(zip(lengths.tolist(), p.texts)):
            words = seg.words(text, p.words[i] if p.words is not None else None)
            wbd[start: start + n - 1] = word_start_flags(tok, tokens[start: start + n - 1], text, words)
            start += n
    return Encoded(chunk.label, tokens, lengths, np.asarray(p.lines, dtype=np.int64), p.utf8_bytes(),
                   chunk.nbytes, p.bad, p.hashes, wbd, (os.getpid(), time.process_time()))
