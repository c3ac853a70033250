"""SentencePiece tokenizers: load one trained by ``python -m llmtrain.tokenizer.train``.

    from llmtrain.tokenizer import load_tokenizer
    tok = load_tokenizer("tokenizers/pd1998-bpe16k")
    ids = tok.encode("人民日报"); tok.decode(ids); tok.vocab_size  # padded to 128

A tokenizer directory holds ``tokenizer.model`` (SentencePiece) and
``tokenizer_meta.json`` (how it was made). Any SentencePiece ``.model`` file also
loads; special ids are then looked up by piece name.

Vocabulary sizes: ``sp_vocab_size`` is the number of pieces; ``vocab_size`` is
that rounded up to a multiple of ``pad_multiple`` (128), the number of embedding
rows of the model, so that every tensor-parallel degree up to 8 (and 128) divides
it. Ids in ``[sp_vocab_size, vocab_size)`` are never produced by ``encode`` and are
skipped by ``decode``.

Byte fallback: characters outside the vocabulary are encoded as UTF-8 byte pieces
``<0xNN>``, so nothing becomes ``<unk>`` and ``decode(encode(t)) == t`` for any
text (tokenizers from our trainer use the identity normalisation rule; the only
exception is a literal U+2581 "▁", SentencePiece's own space symbol).
"""

from __future__ import annotations

import json
import os
from functools import cached_property
from pathlib import Path

import numpy as np

from llmtrain.tokenizer.base import TokenFileInfo

MODEL_FILE = "tokenizer.model"
META_FILE = "tokenizer_meta.json"
PAD_MULTIPLE = 128
SPECIAL_PIECES = {"pad": "<pad>", "unk": "<unk>", "bos": "<s>", "eos": "</s>", "mask": "<mask>", "eod": "<eod>"}


class Tokenizer(TokenFileInfo):
    """A SentencePiece model with the special ids and padded vocabulary size training needs."""

    def __init__(self, model_file: str | os.PathLike, meta: dict | None = None,
                 pad_multiple: int = PAD_MULTIPLE):
        import sentencepiece as spm

        self.model_file = Path(model_file)
        self.meta = meta or {}
        self.sp = spm.SentencePieceProcessor(model_file=str(self.model_file))
        self.sp_vocab_size = self.sp.get_piece_size()
        self.pad_multiple = int(self.meta.get("pad_multiple", pad_multiple))
        self.vocab_size = -(-self.sp_vocab_size // self.pad_multiple) * self.pad_multiple
        self.name = self.meta.get("name") or (self.model_file.parent.name if self.model_file.name == MODEL_FILE
                                               else self.model_file.stem)
        ids = {k: self._piece_id(p) for k, p in SPECIAL_PIECES.items()}
        self.pad_id, self.unk_id = ids["pad"], ids["unk"]
        self.bos_id, self.eos_id, self.mask_id = ids["bos"], ids["eos"], ids["mask"]
        # end-of-document separator written after every document; Megatron's GPT tokenizers
        # use eos for this, which is what a foreign model without <eod> gets
        self.eod_id = ids["eod"] if ids["eod"] is not None else self.eos_id
        if self.eod_id is None:
            raise ValueError(f"{self.model_file}: the model has neither an <eod> nor an </s> piece")

    def _piece_id(self, piece: str) -> int | None:
        i = self.sp.piece_to_id(piece)
        return i if i != self.sp.unk_id() or piece == self.sp.id_to_piece(i) else None

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no bos/eos/eod added)."""
        return self.sp.encode(text)

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        """``encode`` for many texts in one call (SentencePiece's C++ loop)."""
        return self.sp.encode(texts, num_threads=num_threads)

    def encode_documents(self, texts: list[str], num_threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Documents back to back, each followed by ``eod_id``: (tokens [n_tokens] ``dtype``,
        lengths [n_docs] int32 with the EOD counted).

        SentencePiece's batch encoder writes each document's ids into a C++ buffer (numpy output,
        with its ``</s>`` slot appended); one concatenation makes the token array and the slots
        become EODs, so no Python int is ever made for a token."""
        if not texts:
            return np.zeros(0, self.dtype), np.zeros(0, np.int32)
        if self.sp.eos_id() < 0:  # no </s> to reserve the slot: the generic way
            return super().encode_documents(texts, num_threads)
        docs = self.sp.encode(texts, out_type="numpy", add_eos=True, num_threads=num_threads)  # [n_docs] int32
        lengths = np.fromiter(map(len, docs), dtype=np.int32, count=len(docs))  # [n_docs]
        tokens = np.concatenate(docs)  # [n_tokens] int32
        if self.eod_id != self.sp.eos_id():
            tokens[np.cumsum(lengths, dtype=np.int64) - 1] = self.eod_id
        return tokens.astype(self.dtype, copy=False), lengths

    def decode(self, ids) -> str:
        """Text of ``ids``; control tokens and vocabulary padding ids decode to nothing."""
        ids = [int(i) for i in ids if 0 <= int(i) < self.sp_vocab_size]
        return self.sp.decode(ids)

    def id_to_piece(self, i: int) -> str:
        return self.sp.id_to_piece(int(i))

    # ------------------------------------------------------------------ metadata
    def identity(self) -> dict:
        """What a checkpoint stores to refuse a mismatched tokenizer later."""
        return {"name": self.name, "sha256": self.sha256, "vocab_size": self.vocab_size,
                "sp_vocab_size": self.sp_vocab_size, "pad_multiple": self.pad_multiple,
                "model_type": self.meta.get("model_type"),
                "special_ids": {"pad": self.pad_id, "unk": self.unk_id, "bos": self.bos_id, "eos": self.eos_id,
                                "mask": self.mask_id, "eod": self.eod_id}}

    @cached_property
    def token_nbytes(self) -> np.ndarray:
        """[sp_vocab_size] int32: UTF-8 bytes each id decodes to (byte pieces 1, control 0).

        Token byte offsets in a text are the cumulative sum of this table over its ids,
        which aligns tokens with character-level annotations (word boundaries).
        """
        sp = self.sp
        out = np.zeros(self.sp_vocab_size, dtype=np.int32)
        for i in range(self.sp_vocab_size):
            if sp.is_byte(i):
                out[i] = 1
            elif not (sp.is_control(i) or sp.is_unknown(i)):
                out[i] = len(sp.id_to_piece(i).replace("\u2581", " ").encode("utf-8"))
        return out

    def __repr__(self) -> str:
        return (f"Tokenizer({self.name!r}, pieces={self.sp_vocab_size}, vocab_size={self.vocab_size}, "
                f"eod={self.eod_id})")


def load_tokenizer(path: str | os.PathLike):
    """Load a tokenizer directory (``tokenizer.model`` + ``tokenizer_meta.json``) or a ``.model`` file,
    a PaddleNLP WordPiece directory (``vocab.txt``, e.g. an ERNIE checkpoint's:
    :class:`llmtrain.tokenizer.wordpiece.WordPieceTokenizer`, same interface), or a Hugging Face
    ``tokenizer.json`` directory with neither (Qwen2's: :class:`llmtrain.tokenizer.hf.HFTokenizer`, same interface).

    A relative path is resolved against the launch directory, then the repository root
    (:func:`llmtrain.utils.paths.resolve_path`).
    """
    from llmtrain.utils.paths import resolve_path

    p = Path(resolve_path(path))
    if p.is_dir() and not (p / MODEL_FILE).is_file() and (p / "vocab.txt").is_file():
        from llmtrain.tokenizer.wordpiece import WordPieceTokenizer  # PaddleNLP ERNIE/BERT directory

        return WordPieceTokenizer(p)
    if p.is_dir() and not (p / MODEL_FILE).is_file() and (p / "tokenizer.json").is_file():
        from llmtrain.tokenizer.hf import HFTokenizer  # Hugging Face directory (Qwen2, Llama 3, ...)

        return HFTokenizer(p)
    if p.is_dir():
        model, meta_file = p / MODEL_FILE, p / META_FILE
        if not model.is_file():
            raise FileNotFoundError(
                f"tokenizer directory {p} has no {MODEL_FILE}; create it with "
                f"`python -m llmtrain.tokenizer.train --input CORPUS --vocab-size 16000 --output {p}` "
                f"(or scripts/prepare_default_corpus.sh for the default corpus)")
        meta = json.loads(meta_file.read_text()) if meta_file.is_file() else None
        return Tokenizer(model, meta)
    if p.is_file():
        return Tokenizer(p)
    raise FileNotFoundError(
        f"tokenizer {p} does not exist; create it with "
        f"`python -m llmtrain.tokenizer.train --input CORPUS --vocab-size 16000 --output {p}` "
        f"(or scripts/prepare_default_corpus.sh for the default corpus)")


__all__ = ["Tokenizer", "load_tokenizer", "PAD_MULTIPLE", "MODEL_FILE", "META_FILE"]
