"""PaddleNLP WordPiece tokenizers (ERNIE / BERT directories) behind llmtrain's tokenizer interface.

    from llmtrain.tokenizer import load_tokenizer
    tok = load_tokenizer("PADDLENLP_ERNIE_DIR")     # a directory with vocab.txt (+ tokenizer_config.json)
    python -m llmtrain.data.preprocess --input corpus.jsonl --tokenizer PADDLENLP_ERNIE_DIR \\
        --output-prefix data/ernie_text_document --word-boundaries jieba

The directory is loaded by PaddleNLP itself (``AutoTokenizer.from_pretrained(dir)``, offline), so ids
are exactly those an ``ErnieForMaskedLM`` of that directory was trained with (one id per line of
``vocab.txt``; Chinese characters one token each; lower-casing and accent stripping as its
``tokenizer_config.json`` says). What the rest of llmtrain needs is mapped onto it:

- ``encode`` gives ids without ``[CLS]``/``[SEP]`` (documents are packed; ``preprocess`` appends
  ``eod_id`` after each document, which is ``[SEP]``).
- special ids: ``pad_id`` ``[PAD]``, ``unk_id`` ``[UNK]``, ``mask_id`` ``[MASK]``, ``bos_id`` =
  ``cls_id`` ``[CLS]``, ``eos_id`` = ``eod_id`` = ``sep_id`` ``[SEP]``; ``special_ids`` has all of
  the tokenizer's special ids (never masked).
- ``sp_vocab_size``: ids the tokenizer can produce (largest id + 1). ``vocab_size`` (embedding rows):
  the ``vocab_size`` of a ``config.json`` in the same directory (the model's table, which an imported
  checkpoint must match), else ``sp_vocab_size`` rounded up to a multiple of 128 as ours.
- ``byte_starts(text, ids)``: the UTF-8 byte offset where each token starts in ``text``, from
  PaddleNLP's ``get_offset_mapping``; word boundaries (``llmtrain.data.wordbound``) use it, since
  WordPiece drops whitespace and may lower-case, so token lengths do not add up to the text.
- ``sha256`` / ``model_file``: of ``vocab.txt`` (what fixes the ids).

PaddleNLP is an optional dependency (``pip install -e .[paddlenlp]``); it is imported only when a
WordPiece directory is loaded.
"""
from __future__ import annotations

import json
import logging
import os
from functools import cached_property
from pathlib import Path

import numpy as np

from llmtrain.tokenizer.base import TokenFileInfo

VOCAB_FILE = "vocab.txt"
PAD_MULTIPLE = 128


def is_wordpiece_dir(path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / VOCAB_FILE).is_file()


def _quiet_paddlenlp():
    """PaddleNLP logs every tokenizer load at INFO; keep the training log readable."""
    try:
        from paddlenlp.utils.log import logger

        logger.set_level("WARNING")
    except Exception:  # noqa: BLE001 - logging only
        logging.getLogger("paddlenlp").setLevel(logging.WARNING)


class WordPieceTokenizer(TokenFileInfo):
    """PaddleNLP's tokenizer of a local directory, with the attributes llmtrain's data path uses."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        try:
            import paddlenlp  # noqa: F401
        except ImportError as err:
            raise ImportError(f"tokenizer {self.directory} is a PaddleNLP WordPiece directory ({VOCAB_FILE}); "
                              f"loading it needs paddlenlp: pip install -e .[paddlenlp] ({err})") from err
        _quiet_paddlenlp()
        from paddlenlp.transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(self.directory))
        self.model_file = self.directory / VOCAB_FILE
        self.meta = {"model_type": "wordpiece", "tokenizer_class": type(self.hf).__name__}
        vocab = self.hf.get_vocab()  # token -> id (added tokens included)
        self.sp_vocab_size = max(vocab.values()) + 1
        self._id_to_token = {i: t for t, i in vocab.items()}
        self.pad_multiple = PAD_MULTIPLE
        padded = -(-self.sp_vocab_size // self.pad_multiple) * self.pad_multiple
        model_rows = self._config_vocab_size()
        if model_rows is not None and model_rows < self.sp_vocab_size:
            raise ValueError(f"{self.directory}/config.json: vocab_size={model_rows} is smaller than the "
                             f"tokenizer's {self.sp_vocab_size} ids ({VOCAB_FILE})")
        self.vocab_size = model_rows if model_rows is not None else padded
        self.name = self.directory.name
        h = self.hf
        self.pad_id, self.unk_id, self.mask_id = h.pad_token_id, h.unk_token_id, h.mask_token_id
        self.cls_id, self.sep_id = h.cls_token_id, h.sep_token_id
        self.bos_id, self.eos_id = self.cls_id, self.sep_id
        self.eod_id = self.sep_id  # documents are separated by [SEP], as BERT separates segments
        if self.eod_id is None:
            raise ValueError(f"{self.directory}: the tokenizer has no [SEP] token to separate documents")
        self.special_ids = sorted(set(h.all_special_ids))

    def _config_vocab_size(self) -> int | None:
        path = self.directory / "config.json"
        if not path.is_file():
            return None
        with open(path, encoding="utf-8") as f:
            value = json.load(f).get("vocab_size")
        return int(value) if value is not None else None

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no [CLS]/[SEP] added, no truncation)."""
        return self.hf.convert_tokens_to_ids(self.hf.tokenize(text))

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        """Text of ``ids`` as PaddleNLP writes it (WordPiece: tokens joined by spaces, ``##`` glued);
        special tokens and vocabulary padding ids decode to nothing."""
        keep = [int(i) for i in ids if 0 <= int(i) < self.sp_vocab_size and int(i) not in self.special_ids]
        return self.hf.convert_tokens_to_string(self.hf.convert_ids_to_tokens(keep))

    def id_to_piece(self, i: int) -> str:
        return self._id_to_token.get(int(i), "")

    def byte_starts(self, text: str, ids: list[int]) -> np.ndarray:
        """[len(ids)] int64: UTF-8 byte offset in ``text`` where each token of ``encode(text)`` starts."""
        spans = self.hf.get_offset_mapping(text)
        if len(spans) != len(ids):
            raise ValueError(f"{self.directory}: offset mapping has {len(spans)} tokens for {len(ids)} ids")
        char_bytes = np.fromiter((len(ch.encode("utf-8")) for ch in text), dtype=np.int64, count=len(text))
        byte_of_char = np.zeros(len(text) + 1, dtype=np.int64)
        np.cumsum(char_bytes, out=byte_of_char[1:])  # [chars + 1] byte offset of each character
        return byte_of_char[np.array([s for s, _ in spans], dtype=np.int64)]

    # ------------------------------------------------------------------ metadata
    def identity(self) -> dict:
        """What a checkpoint stores to refuse a mismatched tokenizer later."""
        return {"name": self.name, "sha256": self.sha256, "vocab_size": self.vocab_size,
                "sp_vocab_size": self.sp_vocab_size, "pad_multiple": self.pad_multiple,
                "model_type": "wordpiece",
                "special_ids": {"pad": self.pad_id, "unk": self.unk_id, "bos": self.bos_id, "eos": self.eos_id,
                                "mask": self.mask_id, "eod": self.eod_id, "cls": self.cls_id, "sep": self.sep_id}}

    @cached_property
    def token_nbytes(self) -> np.ndarray:
        """[sp_vocab_size] int32: UTF-8 bytes of each token's text (``##`` stripped; specials 0).

        Only a hint: WordPiece text need not add up to the input (whitespace dropped, lower-casing),
        so token offsets come from :meth:`byte_starts`."""
        out = np.zeros(self.sp_vocab_size, dtype=np.int32)
        special = set(self.special_ids)
        for i, t in self._id_to_token.items():
            if i not in special:
                out[i] = len((t[2:] if t.startswith("##") else t).encode("utf-8"))
        return out

    def __repr__(self) -> str:
        return (f"WordPieceTokenizer({str(self.directory)!r}, ids={self.sp_vocab_size}, "
                f"vocab_size={self.vocab_size}, eod=[SEP] {self.eod_id})")
