"""Word-start flags aligned with tokens (for whole-word / entity masking of ERNIE-style models).

    python -m llmtrain.data.preprocess ... --word-boundaries gold --words-key words
    python -m llmtrain.data.preprocess ... --word-boundaries jieba

A token *starts a word* when its first byte is the first byte of a word of the
segmentation (gold words from the corpus, or jieba's). Token byte offsets come from
``Tokenizer.token_nbytes`` (bytes each id decodes to) by a cumulative sum, so the
alignment is a few numpy calls per document; when the pieces do not add up to the
text (a literal U+2581 in the text), the lengths of pieces come from SentencePiece's own
byte offsets; a WordPiece tokenizer (``llmtrain.tokenizer.wordpiece``) gives its offsets
itself.
A token that crosses a word boundary is one unit with the word it starts in; the
EOD appended after a document is flagged 1.
"""

from __future__ import annotations

import numpy as np

MODES = ("jieba", "gold")


def _byte_starts(pieces_nbytes: np.ndarray) -> np.ndarray:
    """[n] exclusive cumulative sum: byte offset where each piece starts."""
    out = np.zeros(len(pieces_nbytes), dtype=np.int64)
    np.cumsum(pieces_nbytes[:-1], out=out[1:])
    return out


def word_start_flags(tok, ids, text: str, words: list[str]) -> np.ndarray:
    """[len(ids)] uint8: 1 where token ``i`` begins a word of ``words`` (which join to ``text``);
    ``ids`` is a list or an integer array."""
    if len(ids) == 0:
        return np.zeros(0, np.uint8)
    ids_arr = np.asarray(ids, dtype=np.int64)
    nbytes = tok.token_nbytes[ids_arr]  # [n_tokens] bytes each token decodes to
    text_bytes = len(text.encode("utf-8"))
    if hasattr(tok, "byte_starts"):  # WordPiece (PaddleNLP): offsets from the tokenizer's own mapping
        tok_starts = tok.byte_starts(text, ids)
    elif int(nbytes.sum()) == text_bytes:
        tok_starts = _byte_starts(nbytes)
    else:  # a piece with U+2581 is a space (1 byte) or the literal symbol (3): SentencePiece's spans tell
        spans = tok.sp.encode(text, out_type="offset_mapping", return_bytes=True)["offsets"]
        if len(spans) != len(ids):
            raise ValueError(f"token offsets: {len(spans)} pieces for {len(ids)} ids")
        # byte pieces are 1 byte each (their spans are those of the whole character)
        nbytes = np.array([1 if tok.sp.is_byte(int(i)) else e - b for i, (b, e) in zip(ids_arr, spans)],
                          dtype=np.int64)
        if int(nbytes.sum()) != text_bytes:
            raise ValueError(f"token offsets: pieces cover {int(nbytes.sum())} bytes of a {text_bytes}-byte text")
        tok_starts = _byte_starts(nbytes)
    word_nbytes = np.fromiter((len(w.encode("utf-8")) for w in words), dtype=np.int64, count=len(words))
    word_starts = _byte_starts(word_nbytes)
    return np.isin(tok_starts, word_starts).astype(np.uint8)


class WordSegmenter:
    """Gives the word list of a document: the gold one passed in, or jieba's."""

    def __init__(self, mode: str):
        if mode not in MODES:
            raise ValueError(f"word boundaries {mode!r}: expected one of {MODES}")
        self.mode = mode
        if mode == "jieba":
            import jieba

            jieba.setLogLevel(60)
            jieba.initialize()
            self._cut = jieba.lcut

    def words(self, text: str, gold: list[str] | None) -> list[str]:
        if self.mode == "gold":
            if gold is None:
                raise ValueError("gold word boundaries need the words field (--words-key)")
            return gold
        return self._cut(text)
